"""The session's role table: which roles run and with what, their worker groups (built, found again
after a controller restart, rebuilt after a failure, closed), the policy -> rollout weight push, and what
a rebuilt worker must be given again: the current config, the reward function, losses shipped from cells,
a push that failed. The one owner of those: a restart or restore re-applies them from here.

    workers = Workers(cfg, specs, name="arith-grpo")
    workers.groups["policy"].call_split("compute_logprobs", batch)
    workers.sync(version=1)          # push the policy's weights into every rollout rank
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from ..errors import UsageError
from . import check_placement, host_role, in_process, make_group, reattach_group
from .base import WorkerGroup
from .errors import WeightSyncError

# role -> (worker class, constructor arguments): what `restart(role)` rebuilds from
RoleSpecs = dict[str, tuple[type, tuple]]


class Workers:
    def __init__(self, cfg, specs: RoleSpecs, name: str, *, reward_fn=None, reattach: bool = False):
        """`specs` in build order (a host role before the roles living in its processes); `reward_fn`, the
        function the reward role was built with. With `reattach`, find the live actors of a detached run named
        `name` instead of starting new ones."""
        self.cfg, self.specs, self.name = cfg, dict(specs), name
        self.reward_fn = reward_fn
        self.custom_losses: dict = {}      # name -> policy loss shipped from a cell (re-shipped after a restart)
        self.push_failed = False           # the last weight push failed after its update: push before generating
        self.held_snapshots: set[str] = set()  # keys of snapshots the workers hold (snapshots.py)
        self.groups: dict[str, WorkerGroup] = {}
        if not reattach:
            check_placement(cfg, list(self.specs))  # a layout the cluster cannot hold: one line, nothing started
        try:
            for role, (cls, args) in self.specs.items():
                self.groups[role] = (reattach_group(cfg, role, name, self.host_of(role)) if reattach else
                                     make_group(cfg, role, cls, *args, name=name, host=self.host_of(role),
                                                wait=False))
            for group in self.groups.values():  # every role's processes import and load at the same time
                group.ready()
            self.one_way_of_calling()
        except BaseException:
            if not reattach:
                self.close()  # no half-built session keeps actors alive
            raise

    def one_way_of_calling(self) -> None:
        """Under Ray, channels (cluster/channel.py) for all roles or for none: a role on another node sends every
        role's calls as Ray tasks, so the weight push goes actor to actor, not through this process."""
        if not in_process(self.cfg) and any(g.channels is None for g in self.groups.values()):
            for g in self.groups.values():
                g.send_by_ray()

    def host_of(self, role: str) -> WorkerGroup | None:
        """The group whose processes `role` lives in (rollout.colocate under Ray), or None."""
        host = host_role(self.cfg, role)
        return self.groups[host] if host else None

    def __contains__(self, role: str) -> bool:
        return role in self.groups

    def __getitem__(self, role: str) -> WorkerGroup:
        return self.groups[role]

    def replace_args(self, role: str, *args: Any) -> None:
        """New constructor arguments for `role` (e.g. a hot-swapped reward function): what a restart uses."""
        cls, _ = self.specs[role]
        self.specs[role] = (cls, args)

    def record_run(self, run_dir: str) -> None:
        """Under Ray, the policy actor remembers its run directory: what `Session.attach(name)` looks up."""
        if not in_process(self.cfg):
            self.groups["policy"].set_meta({"run_dir": run_dir})

    def set_config(self, cfg) -> None:
        """Every worker onto `cfg` (shapes and roles unchanged: branches.variant checks that)."""
        self.cfg = cfg
        for g in self.groups.values():
            g.call("set_config", cfg)

    def set_reward(self, fn) -> None:
        """The reward function of every reward worker, and of any rebuilt one."""
        self.reward_fn = fn
        self.replace_args("reward", fn, self.cfg.reward, in_process(self.cfg))
        self.groups["reward"].call("set_fn", fn)

    def register_policy_loss(self, name: str, fn) -> None:
        self.custom_losses[name] = fn
        self.groups["policy"].call("register_policy_loss", name, fn)

    def pushes_behind_update(self) -> bool:
        """Under Ray the weight push is queued right behind the update in the policy's processes, with no
        round trip in between; not when a sleeping engine must wait for the update to end to wake up."""
        return not in_process(self.cfg) and not self.rollout_sleeps()

    def restart(self, *roles: str) -> tuple[str, ...]:
        """Close and rebuild these roles' workers (a role living in another's processes goes with them;
        hosts are rebuilt before their guests). Returns the roles rebuilt, in order."""
        for role in roles:
            if role not in self.specs:
                raise UsageError(f"unknown role '{role}'; this session has {list(self.specs)}")
        roles = tuple(r for r in self.specs if r in roles or (host_role(self.cfg, r) or "") in roles)
        for role in roles:
            self.groups[role].close()
            cls, args = self.specs[role]
            self.groups[role] = make_group(self.cfg, role, cls, *args, name=self.name, host=self.host_of(role))
        self.one_way_of_calling()
        for role in roles:  # built from the session's first config: bring them onto the current one
            self.groups[role].call("set_config", self.cfg)
        if "policy" in roles:
            for loss_name, fn in self.custom_losses.items():
                self.groups["policy"].call("register_policy_loss", loss_name, fn)
        return roles

    def trainers_past(self, trainer_steps: dict[str, int]) -> tuple[str, int] | None:
        """(role, its optimizer's step count) of the first trainer whose count is not `trainer_steps`' (the
        last committed step's), or None: all where that step left them."""
        for role, expected in trainer_steps.items():
            held = self.groups[role].call("adam_steps")[0] if role in self.groups else expected
            if held != expected:
                return role, held
        return None

    def close(self) -> None:
        for g in list(self.groups.values())[::-1]:  # guests before their hosts
            g.close()

    # ---- weights: policy -> rollout ---------------------------------------------------------------
    def rollout_sleeps(self) -> bool:
        """rollout.colocate on an accelerator: the engine sleeps between rollout and weight sync (on a CPU
        there is nothing to hand over, and two calls a step saved)."""
        return self.cfg.rollout.colocate and any(i.get("device", "cpu") != "cpu"
                                                 for i in self.groups["rollout"].info.values())

    def rollout_dtype(self) -> str:
        """The dtype the rollout engines hold (rollout.dtype as they resolved it): what a push sends them in."""
        return self.groups["rollout"].info.get(0, {}).get("dtype") or self.cfg.model.dtype

    def start_sync(self, version: int) -> tuple:
        """Start pushing the policy's full weights to every rollout rank (tagged `version`)."""
        t0 = time.perf_counter()
        policy, rollout = self.groups["policy"], self.groups["rollout"]
        if self.rollout_sleeps():
            rollout.call("wake_up")
        # a collective when sharded: all ranks. Under Ray the rollout's call is queued on a reference to
        # rank 0's result, so the bytes go policy -> rollout without a round trip through this process. Not a
        # copy: every way there copies them (set_weights into the engine, a Ray push into its buffer first)
        pending = policy.submit_stored("get_weights", copy=False, dtype=self.rollout_dtype(), to=rollout)
        return t0, pending, rollout.submit("set_weights", pending.stored[0], version), version

    def finish_sync(self, started: tuple, since: float | None = None, meanwhile: Callable[[], None] = lambda: None
                    ) -> dict:
        """Wait for the push; `sync/s` counts from its start, or from `since`. `meanwhile()` runs once the
        engine's part is on its way (the controller's own work beside the engine's load), also when the
        policy's part failed. An engine that does not hold what was sent is a WeightSyncError naming rank and
        tensor. A push that fails is remembered (`push_failed`): the next rollout pushes again first (`catch_up`)."""
        self.push_failed = True
        t0, pending, push, version = started
        try:
            self.groups["policy"].collect(pending)  # first: when the policy failed, its own error names it
            self.groups["rollout"].send_held()
        finally:
            try:
                meanwhile()
            except BaseException:
                with contextlib.suppress(Exception):  # nothing of the push left in flight
                    self.groups["rollout"].collect(push)
                raise
        res = self.groups["rollout"].collect(push)
        out = {"sync/s": time.perf_counter() - (since or t0), "sync/bytes": sum(r["bytes"] for r in res)}
        for rank, r in enumerate(res):  # engines that verify their load (HF) say which tensor is not as sent
            if r.get("mismatch"):
                raise WeightSyncError("rollout", rank, "set_weights",
                                      f"after loading weights version {version} the engine's '{r['mismatch']}' "
                                      "differs from what the policy sent (the load was skipped or went into a "
                                      "copy the engine does not use); the next rollout pushes them again")
        out["sync/verified"] = float(all("mismatch" in r for r in res))
        for key in res[0].keys() - {"bytes", "mismatch"}:  # an engine's own timings (vLLM: write_s, reload_s)
            out[f"sync/{key}"] = max(r[key] for r in res)
        self.push_failed = False
        return out

    def sync(self, version: int, meanwhile: Callable[[], None] = lambda: None) -> dict:
        try:
            started = self.start_sync(version)
        except BaseException:
            self.push_failed = True
            meanwhile()
            raise
        return self.finish_sync(started, meanwhile=meanwhile)

    def expect_weights(self, version: int) -> bool:
        """Attached to running workers: unless every engine holds the policy's weights of step `version` (its
        last verified push), the next rollout pushes them first — a controller killed during a push, or after one
        that failed, left a stale engine. Also after a critic's warm-up (no push while the policy waits): one push
        too many. Returns whether one is due."""
        held = [state["weight_version"] for state in self.groups["rollout"].call("get_state")]
        self.push_failed = self.push_failed or any(v != version for v in held)
        return self.push_failed

    def catch_up(self, version: int) -> None:
        """Before generating: push the weights again when the last push failed after its update."""
        if self.push_failed:
            self.sync(version)

    # ---- looking at it ----------------------------------------------------------------------------
    def table(self) -> list[tuple]:
        """(role, rank, pool, node, pid, device, RSS GB) per rank, from what the last calls reported. A node is
        its IP, and the start of its Ray node id when it has one (several nodes can share a machine); a device
        names its dtype where it is not model.dtype (a bf16 rollout engine: rollout.dtype)."""
        out = []
        for role, g in self.groups.items():
            for rank in range(g.world_size):
                info, mem = g.info.get(rank, {}), g.memory.get(rank, {})
                rss = mem.get("rss_gb")
                node = info.get("node", "?") + (f"/{info['node_id'][:6]}" if info.get("node_id") else "")
                device = info.get("device", "?")
                if info.get("dtype") not in (None, self.cfg.model.dtype):
                    device += f" {info['dtype']}"
                out.append((role, rank, info.get("pool", "-"), node, info.get("pid", "?"), device,
                            "-" if rss is None else f"{rss:.2f}"))
        return out
