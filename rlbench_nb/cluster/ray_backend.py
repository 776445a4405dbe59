"""The `ray` backend: each rank of a role is a persistent Ray actor wrapping the same worker class.

    group = RayWorkerGroup(cfg, "policy", PolicyWorker, 2, cfg, model_dir)
    group.call_split("compute_logprobs", batch)      # split by rank, run on all at once, concatenate

Ranks of one role are placed with a placement group and joined in a torch.distributed group (gloo on
CPU, NCCL on GPU) so trainer roles can shard with FSDP2. Every call returns the worker's memory
snapshot alongside its result (no extra round trip). Failures come back as `WorkerError` /
`WorkerDiedError` naming role, rank and method, never as a bare Ray traceback. Where the controller is on
the ranks' machine, calls go over each actor's socket (channel.py, cluster.channels), else as Ray tasks.

Its rooms: ray_connect.py (joining or starting the cluster, finding a detached run), ray_actor.py (the actor
process behind each rank), channel.py (calls over a socket), answers.py (waiting for the ranks' answers and
naming failures), this file (a role's ranks as one group: starting them, sending calls).
"""
from __future__ import annotations

import time
from typing import Any

from ..data.batch import Batch
from . import channel, warm
from .answers import Answers
from .base import CallRecord, Method, Pending, by_reference
from .channel import ChannelCall
from .errors import ClusterError
from .pools import placement
from .ray_actor import WorkerActor


class RayWorkerGroup(Answers):
    def __init__(self, cfg, role: str, worker_cls, world_size: int, *args, name: str = "run",
                 host: RayWorkerGroup | None = None, wait: bool = True):
        """`host`: run this role's ranks inside that group's actors (same processes, rank by rank)
        instead of actors of its own: `rollout.colocate`, the rollout engine next to the policy.
        `wait=False`: return once the actors are asked to start; `ready()` waits for their workers (so a
        session's roles import and load side by side)."""
        c = cfg.cluster
        self.role, self.world_size, self.cfg = role, world_size, cfg
        self.timeout = c.call_timeout_s
        self.records: list[CallRecord] = []
        self.memory: dict[int, dict] = {}
        self.info: dict[int, dict] = {}  # rank -> pid, node, device
        self.host = host
        self._setups: list = []  # the ranks' setup calls until ready() has their answers
        self.warm_names: list[str] = []  # warm processes this group took (warm.py): given back to the keeper on close
        self.channels: list | None = None  # each rank's channel.py socket, where this controller reaches them
        self._unsent: list[Unsent] = []  # calls held until another call's result they pass on is in
        if host is not None:
            if host.world_size != world_size:
                raise ClusterError(f"role '{role}' ({world_size} ranks) cannot live in the '{host.role}' "
                                   f"processes ({host.world_size} ranks): give both the same number of ranks")
            self.actors, self.pg = host.actors, None
            # queued behind the host's own setup: each actor runs one call at a time, in order
            self._setups = [a.setup.remote(None, worker_cls, args, {}, role) for a in self.actors]
            if wait:
                self.ready()
            return
        where = placement(cfg, role)  # pools.py: the role's pool, what one worker reserves, node labels
        self.warm_names = [f"{c.namespace}/{name}/{role}/{rank}" for rank in range(world_size)]
        self.actors = warm.take(self.warm_names, c.detached) if warm.fits(where) else None
        if self.actors is not None:  # processes of `rlbench-nb up`, imports done: they take this role's ranks
            self.pg = None
            for rank, a in enumerate(self.actors):
                a.become.remote(role, rank, world_size, cfg.run.seed, c.num_threads, cfg.run.deterministic,
                                where.pool, where.device)
        else:
            self.warm_names = []
            self._start_actors(cfg, role, world_size, name, where)
        # rank 0's address goes to every rank by reference: Ray hands it over when it is ready, no wait here
        master = self.actors[0].address.remote() if world_size > 1 else None
        self._setups = [a.setup.remote(master, worker_cls, args, {}) for a in self.actors]
        if wait:
            self.ready()

    def _start_actors(self, cfg, role: str, world_size: int, name: str, where) -> None:
        """One new actor per rank, named '<name>/<role>/<rank>', in a placement group of the role's pool."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        c, bundle = cfg.cluster, where.bundle
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK",
                                  name=f"{name}/{role}", lifetime="detached" if c.detached else None,
                                  bundle_label_selector=[dict(where.labels)] * world_size if where.labels else None)
        if not self.pg.wait(c.placement_timeout_s):
            ray.util.remove_placement_group(self.pg)
            raise ClusterError(
                f"role '{role}' (pool '{where.pool}') asked for {world_size} x {bundle} but the cluster could not "
                f"place it within {c.placement_timeout_s:.0f}s; it has {ray.cluster_resources()} in all and "
                f"{ray.available_resources()} free — lower cluster.train_ranks / cluster.rollout_ranks / "
                "the per-worker share (cluster.cpus_per_worker, cluster.pools) or add nodes")
        actor_cls = ray.remote(WorkerActor)
        lifetime = "detached" if c.detached else None
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        self.actors = [
            actor_cls.options(
                name=f"{name}/{role}/{rank}", namespace=c.namespace, lifetime=lifetime,
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=custom or None, max_concurrency=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote(role, rank, world_size, cfg.run.seed, c.num_threads, cfg.run.deterministic, where.pool,
                     where.device)
            for rank in range(world_size)]

    def ready(self) -> RayWorkerGroup:
        """Wait until every rank's worker is built (its imports, model, process group)."""
        if self._setups:
            self.info = dict(enumerate(self._get(self._setups, "__init__")))
            self._setups = []
            self._open_channels()
        return self

    def _open_channels(self) -> None:
        """Calls over each rank's socket where every rank is on this controller's Ray node (cluster.channels),
        else as Ray tasks (`Workers` then sends every group's by Ray: weights between nodes go actor to actor)."""
        import ray
        here = ray.get_runtime_context().get_node_id()
        found = [channel.connect(self.info[r].get("channel"))
                 if self.cfg.cluster.channels and self.info[r].get("node_id") == here else None
                 for r in range(self.world_size)]
        self.channels = found if all(found) else None

    @classmethod
    def reattach(cls, cfg, role: str, world_size: int, name: str,
                 host: RayWorkerGroup | None = None) -> RayWorkerGroup:
        """The group of live named actors '<name>/<role>/<rank>' (e.g. detached ones after a kernel restart),
        or of the role living in `host`'s actors."""
        import ray
        self = cls.__new__(cls)
        self.role, self.world_size, self.cfg, self.host = role, world_size, cfg, host
        self.timeout = cfg.cluster.call_timeout_s
        self.records, self.memory, self._setups, self.warm_names, self.channels = [], {}, [], [], None
        self._unsent = []
        if host is not None:
            self.actors, self.pg = host.actors, None
        else:
            ns = cfg.cluster.namespace
            try:
                self.actors = [warm.named_actor(f"{name}/{role}/{rank}", ns) for rank in range(world_size)]
            except ValueError:
                raise ClusterError(f"no live actors named '{name}/{role}/*' in Ray namespace "
                                   f"'{cfg.cluster.namespace}': the run was closed, or its actors were not "
                                   "detached (cluster.detached: true)") from None
            try:  # none when the ranks are warm processes (they were placed when `rlbench-nb up` started them)
                self.pg = ray.util.get_placement_group(f"{name}/{role}")
                self.warm_names = []
            except ValueError:
                self.pg, self.warm_names = None, [f"{ns}/{name}/{role}/{rank}" for rank in range(world_size)]
        self.info = dict(enumerate(self._get([a.info.remote(role) for a in self.actors], "info")))
        self._open_channels()
        return self

    def set_meta(self, meta: dict) -> None:
        self._get([a.set_meta.remote(meta) for a in self.actors], "set_meta")

    def _calls(self, method: str, per_rank_args: list[tuple], kwargs: dict) -> list:
        return self.collect(self._submit(method, per_rank_args, kwargs))

    def _submit(self, method: str, per_rank_args: list[tuple], kwargs: dict, where: str | None = None) -> Pending:
        """Each rank's call, by its channel where it has one (`where`: a stored call's transport), after the calls
        of this group still held for another call's result (`Unsent`)."""
        self.send_held()
        if self.channels and any(isinstance(a, StoredAnswer) for args in per_rank_args for a in args):
            held = [Unsent(ch, (where, self.role, method, args, kwargs))
                    for ch, args in zip(self.channels, per_rank_args)]
            self._unsent.extend(held)
            return Pending(method, held, time.perf_counter())
        if self.channels:
            calls = [ChannelCall(ch, ch.send((where, self.role, method, args, kwargs)))
                     for ch, args in zip(self.channels, per_rank_args)]
            return Pending(method, calls, time.perf_counter())
        refs = [a.call.remote(self.role, method, *args, **kwargs) for a, args in zip(self.actors, per_rank_args)]
        return Pending(method, refs, time.perf_counter())

    def send_held(self) -> None:
        """Send the held calls in order, each once the result it holds is in; one whose result's call failed fails
        with that error when collected (as a Ray task on a failed reference does)."""
        unsent, self._unsent = self._unsent, []
        for call in unsent:
            where, role, method, args, kwargs = call.request
            try:
                args = tuple(a.value() if isinstance(a, StoredAnswer) else a for a in args)
            except Exception as e:  # noqa: BLE001 - the other call's own error, raised where this one is collected
                call.sent = ChannelCall.answered(False, e)
                continue
            call.sent = ChannelCall(call.channel, call.channel.send((where, role, method, args, kwargs)))

    def send_by_ray(self) -> None:
        """Every call of this group as a Ray task from now on (`Workers`: channels for all roles or for none)."""
        self.channels = None

    @by_reference
    def submit_shards(self, method: Method, batch: Batch, *args, **kwargs) -> Pending:
        """Start `call_shards` without waiting; `collect(pending)` gives the results. Lets roles overlap."""
        return self._submit(method, [(p, *args) for p in batch.chunk(self.world_size)], kwargs)

    def collect(self, pending: Pending) -> list:
        handles = pending.handles
        if handles and isinstance(handles[0], Unsent):
            self.send_held()
            handles = [h.sent for h in handles]
        out = self._get(handles, pending.method)
        end = time.perf_counter()
        for rank, (_, mem, work_s) in enumerate(out):
            self.memory[rank] = mem
            self.records.append(CallRecord(self.role, rank, pending.method, pending.start, end, work_s))
        del self.records[:-1000]
        return [res for res, _, _ in out]

    # ---- dispatch (same surface as LocalWorkerGroup) ---------------------------------------------
    @by_reference
    def call(self, method: Method, *args, **kwargs) -> list:
        """The same arguments to every rank; each argument is stored once in the object store, not per rank."""
        return self.collect(self.submit(method, *args, **kwargs))

    @by_reference
    def submit(self, method: Method, *args, **kwargs) -> Pending:
        """`call` without waiting: `collect(pending)` gives the results."""
        import ray
        if self.world_size > 1 and not self.channels:  # top-level ObjectRef arguments are resolved by Ray
            args = tuple(a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args)
        return self._submit(method, [args] * self.world_size, kwargs)

    @by_reference
    def submit_stored(self, method: Method, *args, to: RayWorkerGroup | None = None, **kwargs) -> Pending:
        """Start `method` on every rank, its results left where they were made; `pending.stored` are
        references to pass to another role's call at once (Ray starts that call when the data is ready),
        `collect(pending)` waits for the ranks' status. Weights go actor to actor, with no wait in between;
        through /dev/shm when every rank of `to` is on this group's rank-0 node."""
        # by node id, not IP: several Ray nodes on one machine share an IP but not a /dev/shm they both watch
        nodes = {info.get("node_id") for info in (to.info.values() if to is not None else [])}
        if to is not None and to.actors == self.actors and self.world_size == 1:
            where = "here"  # the receiver lives in this process: hand the tensors over in memory
        elif to is not None and nodes == {self.info.get(0, {}).get("node_id")} != {None}:
            where = "shm"
        else:
            where = "store"
        self.last_transport = where  # what the latest push went by (sess.groups["policy"].last_transport)
        if self.channels:  # each answer is (result, status): the status for collect, the result to pass on
            sent = self._submit(method, [args] * self.world_size, kwargs, where).handles
            return Pending(method, [c.of(1) for c in sent], time.perf_counter(),
                           [StoredAnswer(self, c.of(0), method) for c in sent])
        calls = [a.call_stored.options(num_returns=2).remote(self.role, method, *args, where=where, **kwargs)
                 for a in self.actors]
        return Pending(method, [status for _, status in calls], time.perf_counter(), [result for result, _ in calls])

    @by_reference
    def call_each(self, method: Method, per_rank_args: list[tuple]) -> list:
        """Rank r gets `per_rank_args[r]`."""
        return self._calls(method, per_rank_args, {})

    @by_reference
    def call_rank0(self, method: Method, *args, **kwargs) -> Any:
        start = time.perf_counter()
        if self.channels:
            self.send_held()
            call = ChannelCall(self.channels[0], self.channels[0].send((None, self.role, method, args, kwargs)))
        else:
            call = self.actors[0].call.remote(self.role, method, *args, **kwargs)
        res, mem, work_s = self._get([call], method)[0]
        self.memory[0] = mem
        self.records.append(CallRecord(self.role, 0, method, start, time.perf_counter(), work_s))
        return res

    @by_reference
    def call_shards(self, method: Method, batch: Batch, *args, **kwargs) -> list:
        parts = batch.chunk(self.world_size)
        return self._calls(method, [(p, *args) for p in parts], kwargs)

    @by_reference
    def call_split(self, method: Method, batch: Batch, *args, **kwargs) -> Batch:
        return Batch.cat(self.call_shards(method, batch, *args, **kwargs))

    def dead_ranks(self, timeout: float = 10.0) -> list[int]:
        """Ranks whose actor process is gone (a quick ping each)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError
        pings = [a.get_meta.remote() for a in self.actors]  # all at once: one timeout, not one per rank
        deadline, dead = time.time() + timeout, []
        for rank, ref in enumerate(pings):
            try:
                ray.get(ref, timeout=max(deadline - time.time(), 0.1))
            except RayActorError:
                dead.append(rank)
            except GetTimeoutError:
                pass  # alive but busy (a hung call): not dead
        return dead

    def close(self) -> None:
        import ray
        if self.host is None:  # the host's channels are its own (a guest role shares them)
            for info in self.info.values():
                channel.disconnect(info.get("channel"))
        self.channels = None
        if self.host is not None:  # the processes are the host's: only this role's workers go
            try:
                ray.wait([a.drop.remote(self.role) for a in self.actors], num_returns=len(self.actors), timeout=10)
            except Exception:
                pass
            self.actors = []
            return
        try:  # engines with processes of their own (vLLM) stop them before their actor goes
            ray.wait([a.close_worker.remote() for a in self.actors], num_returns=len(self.actors), timeout=10)
        except Exception:
            pass
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []
        if self.warm_names:
            warm.release(self.warm_names)
        try:
            ray.util.remove_placement_group(self.pg)
        except Exception:
            pass


class StoredAnswer:
    """A stored call's result sent by channel, to pass to another group's call (`submit_stored`)."""

    def __init__(self, group: RayWorkerGroup, call: ChannelCall, method: str):
        self.group, self.call, self.method = group, call, method

    def value(self):
        """The result, once in (its call's failure raised, named as the sending group names it)."""
        return self.group._get([self.call], self.method)[0]


class Unsent:
    """A rank's call whose arguments hold another call's stored result (the weights' handle for the engine): sent
    once that result is in — when this call is collected, or before the group's next call —, as Ray starts a task
    on a reference once its argument is ready; `sent` is then the call."""

    def __init__(self, channel, request: tuple):
        self.channel, self.request, self.sent = channel, request, None
