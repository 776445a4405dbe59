"""The single controller: phases as method calls on persistent role workers.

    sess = Session(Config.load("configs/arith_grpo.yaml"))
    batch = sess.rollout()          # generate: prompts x rollout.n responses
    batch = sess.score(batch)       # rewards (scores_B, reward_error)
    batch = sess.prepare(batch)     # old/ref log-probs, values, KL, advantages
    stats = sess.update(batch)      # optimizer step(s); weights pushed to the rollout engine
    sess.run(steps=50)              # the same four phases in a loop, with a progress bar
    sess.save("step_50"); sess2 = Session.load(sess.run_dir / "checkpoints" / "step_50")

Phase order lives only here. Each phase's metrics ride on `batch.info["metrics"]`; `update()` ends
the step: it writes one metrics row (JSONL, TensorBoard, `sess.history`) for the batch it trained on.
"""
from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .runner import RunControl

import torch

from . import checkpoint
from .algos import apply_kl_penalty, compute_advantages, kl_penalty, make_kl_controller, masked_mean
from .cluster import host_role, make_group
from .cluster.errors import WorkerError
from .config import Config
from .data.batch import Batch
from .data.datasets import PromptDataset, PromptSampler, read_rows, validate_rows
from .data.tasks import load_task
from .metrics import JSONLSink, TensorBoardSink
from .roles import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker, load_reward_fn, rollout_worker_class

log = logging.getLogger(__name__)


class _hybridmethod:
    """`Session.load(path)` builds a new session; `sess.load(name)` restores into this one."""

    def __init__(self, cls_fn, inst_fn):
        self.cls_fn, self.inst_fn = cls_fn, inst_fn

    def __get__(self, obj, cls):
        return self.cls_fn.__get__(cls, cls) if obj is None else self.inst_fn.__get__(obj, cls)


class Session:
    def __init__(self, cfg: Config | str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                 run_dir: str | Path | None = None, _attach: bool = False):
        if cfg is None or isinstance(cfg, (str, Path)):
            cfg = Config.load(cfg, overrides)
        elif overrides:
            cfg = cfg.override(*overrides)
        self.cfg = cfg
        if cfg.cluster.num_threads:
            torch.set_num_threads(cfg.cluster.num_threads)
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        self.task = load_task(cfg)
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.task.model_dir))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.train_data = self._dataset(cfg.data.train_path, self.task.train_rows, "train")
        self.test_data = self._dataset(cfg.data.test_path, self.task.test_rows, "test")
        self.sampler = PromptSampler(len(self.train_data), cfg.data.batch_size, cfg.run.seed, cfg.data.shuffle)
        self._reward_fn = self.task.verifier if cfg.reward.fn == "task" else load_reward_fn(cfg.reward.fn)

        self.run_dir = Path(run_dir) if run_dir else _fresh_run_dir(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(self.run_dir / "config.yaml")

        model_dir = str(self.task.model_dir)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if cfg.rollout.engine == "vllm" and cfg.cluster.backend == "local":
            from .roles.rollout.vllm_engine import import_vllm
            import_vllm()  # a missing install is one clear line before any worker starts
        # role -> (worker class, constructor args): what restart(role) rebuilds from
        self._roles = {"policy": (PolicyWorker, (cfg, model_dir)),
                       "rollout": (rollout_worker_class(cfg.rollout.engine), (cfg, model_dir, eos, pad)),
                       "reward": (RewardWorker, (self._reward_fn, cfg.reward.timeout_s))}
        if cfg.uses_reference:
            self._roles["reference"] = (ReferenceWorker, (cfg, model_dir))
        if cfg.uses_critic:
            self._roles["critic"] = (CriticWorker, (cfg, model_dir))
        self.groups = {}
        if _attach:  # the actors are alive (detached): find them by name
            from .cluster import world_size_for
            from .cluster.ray_backend import RayWorkerGroup
            for role in self._roles:  # hosts come first in _roles
                self.groups[role] = RayWorkerGroup.reattach(cfg, role, world_size_for(cfg, role), self.name,
                                                            self._host_of(role))
        else:
            try:
                for role, (cls, args) in self._roles.items():
                    self.groups[role] = make_group(cfg, role, cls, *args, name=self.name, host=self._host_of(role))
            except BaseException:
                self.close()  # no half-built session keeps actors alive
                raise
            if cfg.cluster.backend == "ray":
                self.groups["policy"].set_meta({"run_dir": str(self.run_dir.resolve())})

        self.kl_ctrl = make_kl_controller(cfg.algo)
        self.step_count = 0
        self._skipped_in_a_row = 0                           # updates skipped for non-finite numbers, in a row
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self._sinks: list = []
        self._listeners: list[Callable[[dict], None]] = []  # called with each step's row (the dashboard)
        self._pending_error: BaseException | None = None    # a background run's failure, raised on next use
        self.background = None                               # the BackgroundRun, when one was started
        if _attach:
            self._load_controller_state(json.loads((self.run_dir / "controller_state.json").read_text()))
        self._open_sinks()
        self.state = "ready"
        from .ipython import register
        register(self)

    def _host_of(self, role: str):
        """The group whose processes `role` lives in (rollout.colocate under Ray), or None."""
        host = host_role(self.cfg, role)
        return self.groups[host] if host else None

    @property
    def name(self) -> str:
        """The run's name: its directory's name, and the prefix of its Ray actors' names."""
        return self.run_dir.name

    @classmethod
    def attach(cls, name: str, address: str | None = "auto", namespace: str = "rlbench-nb") -> "Session":
        """Pick up a run whose actors outlived their controller (`cluster.detached: true`): same actors,
        weights, optimizer state and step; the metric history comes from the run directory."""
        import ray
        from .cluster.ray_backend import ClusterError, _check_reachable
        if not ray.is_initialized():
            if address and address != "auto":
                _check_reachable(address)
            try:
                ray.init(address=address, namespace=namespace, log_to_driver=False)
            except (ConnectionError, RuntimeError) as e:
                raise ClusterError(f"could not reach the Ray cluster at {address!r}: {str(e).splitlines()[0]}") from None
        try:
            policy0 = ray.get_actor(f"{name}/policy/0", namespace=namespace)
        except ValueError:
            raise ClusterError(f"no run named '{name}' in Ray namespace '{namespace}' (live runs: "
                               f"{sorted({a['name'].split('/')[0] for a in ray.util.list_named_actors(True) if a['namespace'] == namespace})})") from None
        run_dir = Path(ray.get(policy0.get_meta.remote())["run_dir"])
        return cls(Config.load(run_dir / "config.yaml"), run_dir=run_dir, _attach=True)

    def _open_sinks(self) -> None:
        self._sinks = [JSONLSink(self.run_dir / "metrics.jsonl")]
        if self.cfg.run.tensorboard:
            self._sinks.append(TensorBoardSink(self.run_dir / "tb"))

    # ---- data -----------------------------------------------------------------------------------
    def _dataset(self, path: str | None, builtin: list[dict], split: str) -> PromptDataset:
        d = self.cfg.data
        if path:
            numbered, problems = read_rows(path)
            source = str(path)
        else:
            numbered, problems, source = list(enumerate(builtin)), [], f"{self.cfg.task.name}/{split}"
        return validate_rows(numbered, d.prompt_key, d.max_prompt_len,
                             lambda p: len(self._prompt_ids(p)), source, problems)

    def _prompt_ids(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        if self.cfg.data.chat_template and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(prompt)["input_ids"]

    def _encode(self, rows: list[dict], n: int, tag: str) -> Batch:
        """Rows repeated n times, prompts tokenised and left-padded; extra row fields ride along."""
        ids = [x for r in rows for x in [self._prompt_ids(r["prompt"])] * n]  # tokenised once per row
        width = max(map(len, ids))
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        prompt_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        meta = {"prompt": [r["prompt"] for r in rows for _ in range(n)],
                "group": [f"{tag}-{i}" for i in range(len(rows)) for _ in range(n)]}
        row_fields = sorted({k for r in rows for k in r} - {"prompt"})
        for key in row_fields:
            meta[key] = [r.get(key) for r in rows for _ in range(n)]
        return Batch({"prompt_ids_BP": prompt_ids, "prompt_mask_BP": prompt_mask}, meta, {"row_fields": row_fields})

    # ---- phases ---------------------------------------------------------------------------------
    def rollout(self, rows: list[dict] | None = None) -> Batch:
        """Generate `rollout.n` responses for each of the next `data.batch_size` training prompts (or `rows`)."""
        return self._finish_rollout(self._start_rollout(rows))

    def _start_rollout(self, rows: list[dict] | None = None) -> tuple:
        if rows is None:
            rows = [self.train_data.rows[i] for i in self.sampler.next_indices()]
        batch = self._encode(rows, self.cfg.rollout.n, tag=f"s{self.step_count}")
        t0 = time.perf_counter()  # before submitting: the local backend does the work inside submit_shards
        return batch, self.groups["rollout"].submit_shards("generate", _generate_inputs(batch)), t0

    def _finish_rollout(self, started: tuple) -> Batch:
        batch, handle, t0 = started
        batch.update(Batch.cat(self.groups["rollout"].collect(handle)))
        dt = time.perf_counter() - t0
        if self._rollout_sleeps():  # give the accelerator to the trainers until the next weight sync
            self.groups["rollout"].call("sleep")
        self._decode(batch)
        lens = batch["response_mask_BR"].sum(-1).float()
        batch.info.update({"step": self.step_count, "metrics": {
            "time/rollout_s": dt,
            "throughput/rollout_tok_s": lens.sum().item() / max(dt, 1e-9),
            "response_len/mean": lens.mean().item(), "response_len/max": lens.max().item(),
            "response_len/min": lens.min().item(),
            "response_len/clip_frac": (lens >= self.cfg.rollout.max_new_tokens).float().mean().item()}})
        return batch

    def _decode(self, batch: Batch) -> None:
        ids, mask = batch["response_ids_BR"], batch["response_mask_BR"]
        batch["response"] = [self.tokenizer.decode(ids[i][mask[i].bool()].tolist(), skip_special_tokens=True)
                             for i in range(len(batch))]
        batch["response_len_B"] = mask.sum(-1)

    def score(self, batch: Batch) -> Batch:
        """Rewards: `scores_B`, per-sample `reward_error`, and `token_rewards_BR` (score on the last token)."""
        t0 = time.perf_counter()
        batch.update(self.groups["reward"].call_split("score", _reward_inputs(batch)))
        scores, mask = batch["scores_B"], batch["response_mask_BR"]
        last = (mask.sum(-1) - 1).clamp(min=0)
        token_rewards = torch.zeros(mask.shape, dtype=torch.float32)
        token_rewards[torch.arange(len(batch)), last] = scores
        batch["token_rewards_BR"] = token_rewards
        errors = [e for e in batch["reward_error"] if e]
        if errors:
            log.warning("%d reward error(s) this step; first: %s", len(errors), errors[0])
        batch.info.setdefault("metrics", {}).update({
            "time/score_s": time.perf_counter() - t0,
            "reward/mean": scores.mean().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
            "reward/min": scores.min().item(), "reward/max": scores.max().item(), "reward/errors": len(errors)})
        return batch

    def prepare(self, batch: Batch) -> Batch:
        """Old log-probs (policy), reference log-probs and KL, values (critic), advantages and returns."""
        a = self.cfg.algo
        t0 = time.perf_counter()
        if batch.info.get("off_policy"):
            # one step off-policy: the importance ratio is against the policy that generated the batch
            batch["old_logprobs_BR"] = batch["rollout_logprobs_BR"]
        elif not self._reuses_logprobs():
            batch.update(self.groups["policy"].call_split("compute_logprobs", batch))
        mask = batch["response_mask_BR"].float()
        m = batch.info.setdefault("metrics", {})
        rewards = batch["token_rewards_BR"]
        if "reference" in self.groups:
            batch.update(self.groups["reference"].call_split("compute_logprobs", batch))
            kl = kl_penalty(batch["old_logprobs_BR"], batch["ref_logprobs_BR"], a.kl_estimator)
            m["kl/ref"] = masked_mean(kl, mask).item()
            m["kl/coef"] = self.kl_ctrl.value
            if a.kl_in == "reward":
                rewards, current = apply_kl_penalty(rewards, batch["old_logprobs_BR"], batch["ref_logprobs_BR"],
                                                    mask, self.kl_ctrl.value, a.kl_estimator)
            else:
                current = masked_mean(kl, mask, dim=-1).mean().item()
            self.kl_ctrl.update(current, n_steps=len(batch))
        if "critic" in self.groups:
            batch.update(self.groups["critic"].call_split("compute_values", batch))
            m["critic/values_mean"] = masked_mean(batch["values_BR"], mask).item()
        adv, returns = compute_advantages(a.advantage, rewards, mask, group_ids=batch["group"],
                                          values_BT=batch.get("values_BR"), cfg=a)
        batch["advantages_BR"] = adv
        if returns is not None:
            batch["returns_BR"] = returns
        batch["advantage"] = [float(x) for x in (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)]
        dt = time.perf_counter() - t0
        m.update({"time/prepare_s": dt, "advantage/mean": masked_mean(adv, mask).item(),
                  "advantage/abs_max": (adv.abs() * mask).max().item(),
                  "throughput/prepare_tok_s": _total_tokens(batch) / max(dt, 1e-9)})
        return batch

    def _reuses_logprobs(self) -> bool:
        """algo.reuse_logprobs, where it is exact: the update's first forward sees the weights that sampled."""
        t = self.cfg.train
        return (self.cfg.algo.reuse_logprobs and t.epochs == 1 and t.mini_batches == 1
                and "reference" not in self.groups)

    def update(self, batch: Batch) -> dict:
        """Critic and policy optimizer steps on `batch`, then weights to the rollout engine. Ends the step."""
        if "advantages_BR" not in batch:
            raise ValueError("update(batch) needs a prepared batch: call sess.prepare(sess.score(batch)) first")
        m = dict(batch.info.get("metrics", {}))
        t0 = time.perf_counter()
        if "critic" in self.groups:
            shards = _minibatch_major(batch, self.cfg.train.mini_batches, self.groups["critic"].world_size)
            m.update(_mean_over_ranks(self.groups["critic"].call_shards("update", shards)))
        if self.step_count >= self.cfg.train.critic_warmup:
            policy = self.groups["policy"]
            shards = _minibatch_major(batch, self.cfg.train.mini_batches, policy.world_size)
            handle = policy.submit_shards("update", shards, self.kl_ctrl.value)
            # under Ray the weight push is queued right behind the update in the policy's processes, with no
            # round trip in between; not when a sleeping engine must wait for the update to end to wake up
            early = self._start_sync() if self.cfg.cluster.backend == "ray" and not self._rollout_sleeps() else None
            m.update(_mean_over_ranks(policy.collect(handle)))
            # sync/s of a push queued behind the update: what it added after the update
            m.update(self._finish_sync(early, since=time.perf_counter()) if early else self.sync_weights())
        dt = time.perf_counter() - t0
        m["time/update_s"] = dt
        m["throughput/update_tok_s"] = _total_tokens(batch) * self.cfg.train.epochs / max(dt, 1e-9)
        for role, group in self.groups.items():  # snapshots came back with this step's calls
            m[f"memory/{role}_peak_gb"] = max((v["peak_rss_gb"] for v in group.memory.values()), default=0.0)
        # phases in sequence add up; overlapped (async) steps report their wall time
        m["time/step_s"] = time.perf_counter() - batch.info["wall_start"] if "wall_start" in batch.info else \
            sum(m.get(f"time/{p}_s", 0.0) for p in ("rollout", "score", "prepare", "update"))
        self.step_count += 1
        self._log(m)
        self._check_skips(m)
        for listener in list(self._listeners):
            listener(m)
        checkpoint.write_json(self.run_dir / "controller_state.json", self._controller_state())
        k = self.cfg.run.save_rollouts_every
        if k and self.step_count % k == 0:
            self.save_rollouts(batch)
        return m

    def _check_skips(self, m: dict) -> None:
        """Warn on a skipped update; stop after train.max_skipped_steps in a row (the row is written first)."""
        skipped = m.get("update/skipped", 0)
        if not skipped:
            self._skipped_in_a_row = 0
            return
        what = " and ".join(name for name, key in (("loss", "update/skipped_nonfinite_loss"),
                                                   ("gradient norm", "update/skipped_nonfinite_grad")) if m.get(key))
        total = self.cfg.train.epochs * self.cfg.train.mini_batches
        log.warning("step %d: %g of %d optimizer step(s) skipped: non-finite %s (weights and optimizer untouched)",
                    self.step_count, skipped, total, what)
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped >= total else 0
        if self._skipped_in_a_row >= self.cfg.train.max_skipped_steps:
            self._skipped_in_a_row = 0
            raise FloatingPointError(
                f"the policy update was skipped {self.cfg.train.max_skipped_steps} steps in a row (up to step "
                f"{self.step_count}): non-finite {what}. The weights are those of the last good update and every "
                "metric row is written; look at reward/* and advantage/* in metrics.jsonl, lower train.lr, or "
                "check the reward function's scale, then resume from the latest checkpoint")

    def sync_weights(self) -> dict:
        """Push the policy's full weights to every rollout rank; bytes and seconds are metrics."""
        return self._finish_sync(self._start_sync())

    def _start_sync(self) -> tuple:
        t0 = time.perf_counter()
        policy, rollout = self.groups["policy"], self.groups["rollout"]
        if self._rollout_sleeps():
            rollout.call("wake_up")
        # a collective when sharded: all ranks. Under Ray the rollout's call is queued on a reference to
        # rank 0's result, so the bytes go policy -> rollout without a round trip through this process
        pending = policy.submit_stored("get_weights", to=rollout)
        return t0, pending, rollout.submit("set_weights", policy.stored(pending)[0], self.step_count + 1)

    def _finish_sync(self, started: tuple, since: float | None = None) -> dict:
        """Wait for the push; `sync/s` counts from its start, or from `since`."""
        t0, pending, push = started
        t0 = since or t0
        self.groups["policy"].collect(pending)  # first: when the policy failed, its own error names it
        res = self.groups["rollout"].collect(push)
        out = {"sync/s": time.perf_counter() - t0, "sync/bytes": sum(r["bytes"] for r in res)}
        for key in res[0].keys() - {"bytes"}:  # an engine's own timings (vLLM: write_s, reload_s), slowest rank
            out[f"sync/{key}"] = max(r[key] for r in res)
        return out

    def _rollout_sleeps(self) -> bool:
        """rollout.colocate on an accelerator: the engine sleeps between rollout and weight sync (on a CPU
        there is nothing to hand over, and two calls a step saved)."""
        return self.cfg.rollout.colocate and any(i.get("device", "cpu") != "cpu"
                                                 for i in self.groups["rollout"].info.values())

    def restart(self, *roles: str) -> "Session":
        """Rebuild roles' workers (e.g. after a process died). Trainer roles come back from the latest
        checkpoint, and the whole session returns to that checkpoint's step so every role agrees."""
        for role in roles:
            if role not in self._roles:
                raise ValueError(f"unknown role '{role}'; this session has {list(self._roles)}")
        # a role living in another's processes goes with them; hosts are rebuilt before their guests
        roles = tuple(r for r in self._roles if r in roles or (host_role(self.cfg, r) or "") in roles)
        trainers = [r for r in roles if r in ("policy", "critic")]
        if trainers and not (self.run_dir / "checkpoints" / "latest").exists():
            raise checkpoint.CheckpointError(
                f"cannot restart '{trainers[0]}': no checkpoint in {self.run_dir}/checkpoints to restore its "
                "weights from; save regularly (run.checkpoint_every) or start a new session")
        for role in roles:  # every role first, then weights: a restore syncs into the rollout engine
            self.groups[role].close()
            cls, args = self._roles[role]
            if role == "reward":
                args = (self._reward_fn, self.cfg.reward.timeout_s)
            self.groups[role] = make_group(self.cfg, role, cls, *args, name=self.run_dir.name, host=self._host_of(role))
        if trainers:
            self._restore(self.run_dir)
        elif "rollout" in roles:
            self.sync_weights()
        return self

    def step(self) -> dict:
        """One iteration: rollout -> score -> prepare -> update. Returns the step's metrics row."""
        return self.update(self.prepare(self.score(self.rollout())))

    # ---- background runs and the dashboard -------------------------------------------------------
    def _raise_pending_error(self) -> None:
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise RuntimeError(f"the background run failed at step {self.step_count + 1}: "
                               f"{type(err).__name__}: {err}") from err

    def pause(self) -> None:
        """Pause the background run at the next step boundary."""
        if self.background:
            self.background.pause()

    def resume(self) -> None:
        if self.background:
            self.background.resume()

    def stop(self) -> None:
        """Stop the background run at the next step boundary (it still writes its summary and checkpoint)."""
        if self.background:
            self.background.stop()

    def dashboard(self, max_points: int = 500):
        """Live widget: reward, accuracy, length, KL, entropy, losses, clipping, grad norm, throughput,
        memory, and a phase timeline; Pause / Resume / Stop buttons for background runs."""
        from .widgets import Dashboard
        return Dashboard(self, max_points=max_points)

    def inspect(self, batch: "Batch | str | Path | None" = None):
        """Rollout inspector for a batch, or a saved rollouts file (default: the latest one of this run)."""
        from .widgets import Inspector
        if batch is None:
            files = sorted((self.run_dir / "rollouts").glob("step_*.jsonl"))
            if not files:
                raise ValueError("no batch given and no saved rollouts yet in this run (run.save_rollouts_every)")
            batch = files[-1]
        return Inspector(batch, tokenizer=self.tokenizer)

    def run(self, steps: int | None = None, progress: bool = True, async_rollout: bool = False,
            background: bool = False, control: "RunControl | None" = None, on_failure: str = "raise"):
        """`steps` iterations (default run.steps) with a progress bar; held-out accuracy before and after.

        With `async_rollout=True` the next batch is generated while this one is scored, prepared and
        trained on (one step off-policy; the loss's importance ratio uses the generating policy's
        log-probs). Under the `local` backend there is nothing to overlap with, so it only changes which
        weights generate. Writes `summary.json` into the run directory and returns it.

        With `background=True` (in a Jupyter kernel) the same loop runs in a worker thread and this returns
        a `BackgroundRun` at once: the kernel stays free, `sess.pause()` / `resume()` / `stop()` (or the
        dashboard's buttons) act at the next step boundary, never mid-update; `await run` gives the summary.

        `on_failure="restore"`: when a worker process dies or stops answering, its role is rebuilt
        (`restart`: trainer roles come back from the latest checkpoint, and the session with them) and the
        run goes on until it has done `steps` steps past where it started — at most 3 times per call.
        Metric rows past the restored step move to metrics.superseded.jsonl; no checkpoint is touched.
        """
        if on_failure not in ("raise", "restore"):
            raise ValueError(f"on_failure={on_failure!r}: use 'raise' or 'restore'")
        if async_rollout and self.cfg.rollout.colocate:
            raise ValueError("async_rollout overlaps generation with the update, but rollout.colocate runs the "
                             "rollout engine on the trainers' devices (under Ray, in the policy's processes), "
                             "asleep during updates: turn one of them off")
        if background:
            from .runner import BackgroundRun
            return BackgroundRun.start(self, steps, async_rollout, on_failure)
        if control is None:  # a background run's own thread passes its control; anyone else checks first
            self._raise_pending_error()
        from tqdm.auto import tqdm
        steps = self.cfg.run.steps if steps is None else steps
        t0 = time.time()
        self.state = "running"
        target, restores = self.step_count + steps, 0
        try:
            if not self.evals:
                self.evaluate()
            before = self.evals[0]
            bar = tqdm(total=steps, desc="train", disable=not progress, dynamic_ncols=True)
            pending = None
            while self.step_count < target:
                if control is not None and not control.proceed():
                    break  # stopped at a step boundary: the summary below still gets written
                try:
                    if async_rollout and pending is None:
                        pending = self._start_rollout()
                    if pending is None:
                        row = self.step()
                    else:
                        t_step = time.perf_counter()
                        batch = self._finish_rollout(pending)
                        batch.info.update(off_policy=True, wall_start=t_step)
                        # queued before this update's weight sync: generated with the weights of this step
                        pending = self._start_rollout() if self.step_count + 1 < target else None
                        row = self.update(self.prepare(self.score(batch)))
                except WorkerError as e:
                    if on_failure != "restore" or restores >= 3:
                        raise
                    restores += 1
                    pending = None  # an in-flight rollout belongs to the failed state
                    self._restore_after(e)
                    bar.n = max(0, self.step_count - (target - steps))
                    bar.refresh()
                    continue
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}", step_s=f"{row['time/step_s']:.2f}")
                if self.cfg.run.eval_every and self.step_count % self.cfg.run.eval_every == 0:
                    self.evaluate()
                if self.cfg.run.checkpoint_every and self.step_count % self.cfg.run.checkpoint_every == 0:
                    self.save(f"step_{self.step_count}")
            bar.close()
            after = self.evals[-1] if self.evals[-1]["step"] == self.step_count else self.evaluate()
            self.save(f"step_{self.step_count}")
        except BaseException:
            self.state = "failed"
            raise
        self.state = "finished"
        return self._write_summary(before, after, time.time() - t0, steps)

    def _restore_after(self, error: WorkerError) -> None:
        """on_failure='restore': rebuild every role with a dead rank (or the role that stopped answering)."""
        roles = [r for r, g in self.groups.items() if g.dead_ranks()] or [error.role]
        log.warning("step %d: %s — restarting %s (on_failure='restore')", self.step_count + 1,
                    str(error).splitlines()[0], ", ".join(roles))
        self.restart(*roles)

    def _write_summary(self, before: dict, after: dict, wall_s: float, steps: int) -> dict:
        rewards = [r["reward/mean"] for r in self.history if "reward/mean" in r]
        k = max(1, min(10, len(rewards) // 4 or 1))
        summary = {
            "run_dir": str(self.run_dir), "steps": self.step_count, "steps_this_run": steps,
            "wall_s": round(wall_s, 1),
            "accuracy_before": before["eval/accuracy"], "accuracy_after": after["eval/accuracy"],
            "accuracy_gain": after["eval/accuracy"] - before["eval/accuracy"],
            "eval_prompts": after["eval/n"],
            "reward_first": sum(rewards[:k]) / k if rewards else None,
            "reward_last": sum(rewards[-k:]) / k if rewards else None,
            "final_metrics": self.history[-1] if self.history else {},
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def evaluate(self, rows: list[dict] | None = None) -> dict:
        """Greedy decoding on the held-out prompts; `eval/accuracy` is the share scoring the maximum 1.0."""
        rows = rows if rows is not None else self.test_data.rows
        params = self.cfg.rollout.model_copy(update={"temperature": 0.0, "n": 1})
        batch = self._encode(rows, 1, tag="eval")
        batch.update(self.groups["rollout"].call_split("generate", _generate_inputs(batch), params))
        self._decode(batch)
        batch.update(self.groups["reward"].call_split("score", _reward_inputs(batch)))
        scores = batch["scores_B"]
        result = {"step": self.step_count, "eval/accuracy": (scores >= 1.0).float().mean().item(),
                  "eval/reward_mean": scores.mean().item(), "eval/n": len(rows)}
        self.evals.append(result)
        for s in self._sinks:
            s.write(self.step_count, {k: v for k, v in result.items() if k != "step"})
        for listener in list(self._listeners):
            listener(None)  # None: not a step; redraw now
        return result

    # ---- reward hot-swap ------------------------------------------------------------------------
    def set_reward(self, fn: Callable[..., float]) -> Callable[..., float]:
        """Replace the reward function on every reward worker; `score(batch)` re-scores with it.

        The function must survive pickling (cloudpickle, as Ray ships it), under every backend, so a
        notebook that works locally works on a cluster."""
        if not callable(fn):
            raise TypeError(f"set_reward needs a function, got {type(fn).__name__}")
        try:
            from ray import cloudpickle
            cloudpickle.dumps(fn)
        except Exception as e:
            raise ValueError(f"reward function '{getattr(fn, '__name__', fn)}' cannot be shipped to the reward "
                             f"workers: {type(e).__name__}: {e} — define it at the top level of a cell and keep "
                             "locks, open files, sessions and models out of what it captures") from None
        self._reward_fn = fn
        self.groups["reward"].call("set_fn", fn)
        return fn

    reward = set_reward  # as a decorator: @sess.reward

    # ---- logging, rollouts, checkpoints ----------------------------------------------------------
    def _log(self, row: dict) -> None:
        self.history.append({"step": self.step_count, **row})
        for s in self._sinks:
            s.write(self.step_count, row)

    def save_rollouts(self, batch: Batch) -> Path:
        """rollouts/step_N.jsonl: prompt, response, reward, advantage, error per sample."""
        d = self.run_dir / "rollouts"
        d.mkdir(exist_ok=True)
        path = d / f"step_{self.step_count:06d}.jsonl"
        fields = [f for f in ("prompt", "response", "answer", "scores_B", "advantage", "response_len_B",
                              "reward_error", "group") if f in batch]
        with path.open("w", encoding="utf-8") as f:
            for row in batch.rows(fields):
                f.write(json.dumps(row, default=str) + "\n")
        return path

    def _save(self, name: str) -> Path:
        """A checkpoint that resumes exactly: weights, optimizer, RNG, data position, step, KL controller."""
        final = self._ckpt_path(name)
        controller = self._controller_state()

        def write(tmp: Path) -> None:
            self.cfg.save(tmp / "config.yaml")
            (tmp / "controller.json").write_text(json.dumps(controller, indent=1))
            self.groups["policy"].call("save", str(tmp / "policy"))  # all ranks: gathers when sharded
            if "critic" in self.groups:
                self.groups["critic"].call("save", str(tmp / "critic"))
            torch.save(self.groups["rollout"].call("get_state"), tmp / "rollout_state.pt")

        checkpoint.write_atomically(final, write)
        return final

    def _restore(self, name: str | Path) -> "Session":
        path = checkpoint.resolve(Path(name) if Path(name).exists() else self._ckpt_path(name))
        self.groups["policy"].call("load", str(path / "policy"))
        if "critic" in self.groups:
            self.groups["critic"].call("load", str(path / "critic"))
        self.sync_weights()
        states = checkpoint.load_tensors(path / "rollout_state.pt")  # one per rollout rank
        if len(states) != self.groups["rollout"].world_size:
            raise checkpoint.CheckpointError(f"checkpoint {path} has {len(states)} rollout rank(s); this session has "
                                             f"{self.groups['rollout'].world_size}: set cluster.rollout_ranks to match")
        self.groups["rollout"].call_each("set_state", [(s,) for s in states])
        for s in self._sinks:  # the metrics file is rewritten when the state loads: reopen after
            s.close()
        self._load_controller_state(json.loads((path / "controller.json").read_text()))
        self._open_sinks()
        return self

    def _controller_state(self) -> dict:
        return {"step": self.step_count, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "evals": self.evals, "run_dir": str(self.run_dir)}

    def _load_controller_state(self, state: dict) -> None:
        self.step_count = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.evals = state["evals"]
        self.history = checkpoint.truncate_metrics(self.run_dir / "metrics.jsonl", self.step_count)

    @classmethod
    def _load_new(cls, path: str | Path, run_dir: str | Path | None = None, overrides=()) -> "Session":
        path = checkpoint.resolve(Path(path))
        controller = json.loads((path / "controller.json").read_text())
        cfg = Config.load(path / "config.yaml", overrides)
        run_dir = Path(run_dir) if run_dir else Path(controller["run_dir"])
        return cls(cfg, run_dir=run_dir)._restore(path)

    save = _save
    load = _hybridmethod(_load_new, _restore)

    def _ckpt_path(self, name: str | Path) -> Path:
        return self.run_dir / "checkpoints" / str(name)

    def close(self) -> None:
        for s in getattr(self, "_sinks", []):
            s.close()
        self._sinks = []
        for g in getattr(self, "groups", {}).values():
            g.close()
        if self.cfg.cluster.backend == "ray":
            from .cluster.ray_backend import shutdown_if_ours
            shutdown_if_ours()
        self.state = "closed"

    # ---- display --------------------------------------------------------------------------------
    def _roles_table(self) -> list[tuple]:
        """(role, rank, node, pid, device, RSS GB) per rank, from what the last calls reported."""
        out = []
        for role, g in self.groups.items():
            for rank in range(g.world_size):
                info, mem = g.info.get(rank, {}), g.memory.get(rank, {})
                rss = mem.get("rss_gb")
                out.append((role, rank, info.get("node", "?"), info.get("pid", "?"), info.get("device", "?"),
                            "-" if rss is None else f"{rss:.2f}"))
        return out

    def __repr__(self) -> str:
        lines = [f"Session(state={self.state}, step={self.step_count}, algo={self.cfg.algo.advantage}, "
                 f"backend={self.cfg.cluster.backend}, run_dir={self.run_dir})"]
        lines += [f"  {r:<10} rank {k}  node={n} pid={p} device={d} rss_gb={m}" for r, k, n, p, d, m in self._roles_table()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from html import escape
        rows = "".join("<tr>" + "".join(f"<td>{escape(str(x))}</td>" for x in row) + "</tr>"
                       for row in self._roles_table())
        return (f"<div><b>rlbench-nb Session</b> — state <b>{self.state}</b>, step {self.step_count}, "
                f"algo {self.cfg.algo.advantage}, backend {self.cfg.cluster.backend}<br>"
                f"<code>{escape(str(self.run_dir))}</code><table style='font-size:12px'><tr><th>role</th>"
                f"<th>rank</th><th>node</th><th>pid</th><th>device</th><th>RSS GB</th></tr>{rows}</table></div>")


def _generate_inputs(batch: Batch) -> Batch:
    """What a rollout engine reads: the prompt tokens."""
    return batch.only("prompt_ids_BP", "prompt_mask_BP")


def _reward_inputs(batch: Batch) -> Batch:
    """What a reward function is given: prompt, response and the dataset row's fields."""
    return batch.only("prompt", "response", *batch.info.get("row_fields", ()))


def _total_tokens(batch: Batch) -> float:
    return (batch["prompt_mask_BP"].sum() + batch["response_mask_BR"].sum()).item()


def _minibatch_major(batch: Batch, n_mini: int, world: int) -> Batch:
    """Reorder rows so that splitting by rank, then each rank splitting into `n_mini` mini-batches, puts
    the rows of global mini-batch j on the ranks' j-th mini-batches: any number of ranks then takes
    the same optimizer steps on the same data."""
    if world == 1:
        return batch
    parts = [mini.chunk(world) for mini in batch.chunk(n_mini)]
    return Batch.cat([parts[j][r] for r in range(world) for j in range(n_mini)])


def _mean_over_ranks(stats: list[dict]) -> dict:
    keys = {k for s in stats for k in s}
    return {k: sum(s.get(k, 0.0) for s in stats) / len(stats) for k in keys}


def _fresh_run_dir(cfg: Config) -> Path:
    base = Path(cfg.run.dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path
