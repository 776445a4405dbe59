"""The single controller: phases as method calls on persistent role workers.

    with rl.Session(rl.Config.load("configs/arith_grpo.yaml")) as sess:
        batch = sess.rollout()          # generate: prompts x rollout.n responses
        batch = sess.score(batch)       # rewards (scores_B, reward_error)
        batch = sess.prepare(batch)     # old/ref log-probs, values, KL, advantages
        stats = sess.update(batch)      # optimizer step(s); weights pushed to the rollout engine; ends the step
        sess.run(steps=50)              # the same four phases in a loop (runner.py), with a progress bar
        sess.save("step_50")            # checkpoint.py; rl.Session.load(run_dir) resumes exactly

Phase order lives only here. Each phase reads a batch, calls workers, computes its metrics with a
function (metrics/compute.py) and returns a *new* batch: the one it was given is left as it was, so a
notebook cell can be re-run, and "before vs after" compares two objects. Phases change no hidden state
but `rollout`'s data position and `update`'s step; an interrupt (Ctrl-C) waits for the phase to finish.

Rooms: progress.py (step, data position, KL controller), phase_calls.py (what each phase asks of which
workers), prompts.py (text <-> tokens), cluster/workers.py (roles and weight sync), metrics/log.py (history,
sinks, subscribers), rundir.py (files), checkpoint.py (save/load), runner.py (the loop, background runs).
"""
from __future__ import annotations

import shutil
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from . import checkpoint, cluster, phase_calls, runner, views, whatif
from .cluster.workers import Workers
from .config import Config
from .data.batch import Batch
from .determinism import seed_process
from .errors import UsageError
from .guard import SessionGuard, deferred_interrupts
from .inputs import load_inputs
from .metrics import compute, timeline
from .metrics.health import SkipWatch, mismatch_alarm
from .metrics.log import MetricsLog
from .metrics.trackers import make_trackers
from .phase_calls import StartedRollout
from .progress import Progress
from .prompts import remember_tokenizer
from .roles import role_specs
from .roles.rollout.base import RolloutWorker
from .rundir import Lease, RunDir, fresh_run_dir

_LIVE: weakref.WeakSet = weakref.WeakSet()  # open sessions: `%rl status`, and scripts saving on Ctrl-C


def live_sessions() -> list[Session]:
    return [s for s in list(_LIVE) if s.state != "closed"]


class _hybridmethod:
    """`Session.load(path)` builds a new session; `sess.load(name)` restores into this one."""

    def __init__(self, cls_fn, inst_fn):
        self.cls_fn, self.inst_fn = cls_fn, inst_fn

    def __get__(self, obj, cls):
        return self.cls_fn.__get__(cls, cls) if obj is None else self.inst_fn.__get__(obj, cls)


class Session:
    def __init__(self, cfg: Config | str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                 run_dir: str | Path | None = None, *, take_over: bool = False, _attach: bool = False):
        """A session writing a new run directory (or `run_dir`), its one writer (rundir.Lease; `take_over=True`)."""
        self.cfg = cfg = Config.of(cfg, overrides)
        self.guard = SessionGuard()  # guard.py: one phase at a time, its owner thread, Ctrl-C held
        seed_process(cfg)
        # under Ray the task, tokenizer and data load while this thread starts (or joins) the cluster
        cluster.while_connecting(cfg, lambda: self._load_inputs(run_dir))
        specs = self._role_specs()
        self.rundir = RunDir(run_dir or fresh_run_dir(cfg))
        self.lease = Lease(self.run_dir)
        self.lease.acquire(take_over)  # before any worker starts: a refused second controller costs none
        trackers = self._start_workers(specs, _attach)
        self.skips = SkipWatch(cfg.train.epochs * cfg.train.mini_batches, cfg.train.max_skipped_steps)
        self.metrics = MetricsLog(self.run_dir, cfg.run.tensorboard, trackers, cfg.run.tracker_samples)
        self.background = None              # the BackgroundRun, when one was started
        self.current_branch = None          # the Branch being run (set by branches.branch), or None: the main line
        self.branches: dict = {}            # name -> Branch, every branch this session ran
        self.state = "ready"
        if _attach:
            self.load_controller_state(self.rundir.read_state())
            if self.progress.trainers_ahead(self.workers):
                self.state = "needs_resync"
            self.workers.expect_weights(self.step_count)
        _LIVE.add(self)

    def _load_inputs(self, run_dir: str | Path | None = None) -> None:
        """inputs.py: all checked before the run directory is claimed or any worker starts."""
        self._inputs = inputs = load_inputs(self.cfg, run_dir)  # its reward_fn: what the reward workers start with
        self.task, self.prompts = inputs.task, inputs.prompts
        self.train_data, self.test_data = inputs.train_data, inputs.test_data
        self.progress = Progress.start(self.cfg, len(self.train_data))  # step, data position, KL controller
        self._env_cls = inputs.env_cls

    def _start_workers(self, specs: dict, attach: bool) -> list:
        """The run directory's config and tokenizer, the trackers (returned) and the workers. A session that
        never started holds nothing: its run's lease, its tracker runs."""
        trackers = []
        try:
            self.rundir.write_config(self.cfg)
            remember_tokenizer(self.run_dir, self.prompts.tokenizer, str(self.task.model_dir))
            trackers = make_trackers(self.cfg.run.trackers, self.run_dir, self.cfg)  # a bad one costs no workers
            self.workers = Workers(self.cfg, specs, self.name, reward_fn=self._inputs.reward_fn, reattach=attach)
        except BaseException:
            for tracker in trackers:
                tracker.close()
            self.lease.release()
            raise
        if not attach:
            self.workers.record_run(str(self.run_dir))
        return trackers

    def _role_specs(self) -> dict:
        if self.cfg.rollout.engine == "vllm" and cluster.in_process(self.cfg):
            from .roles.rollout.vllm_engine import import_vllm
            import_vllm()  # a missing install is one clear line before any worker starts
        tok, task = self.prompts.tokenizer, self.task
        return role_specs(self.cfg, str(task.model_dir), tok.eos_token_id, tok.pad_token_id, self._inputs.reward_fn,
                          str(task.reward_model_dir), in_process=cluster.in_process(self.cfg))

    @classmethod
    def attach(cls, name: str, address: str | None = "auto", namespace: str = "rlbench-nb", *,
               take_over: bool = False) -> Session:
        """Pick up a run whose actors outlived their controller (`cluster.detached: true`): same actors,
        weights, optimizer state and step; the metric history comes from the run directory. Refused while
        another live controller drives the run, unless `take_over=True`."""
        run_dir = Path(cluster.find_run(name, address, namespace)["run_dir"])
        return cls(Config.load(run_dir / "config.yaml"), run_dir=run_dir, take_over=take_over, _attach=True)

    # ---- what the session holds ------------------------------------------------------------------
    @property
    def state(self) -> str:
        """'ready', 'running' (a run() is stepping it), 'needs_resync' (an update was abandoned), 'closed'."""
        return self.guard.state

    @state.setter
    def state(self, value: str) -> None:
        self.guard.state = value

    @property
    def step_count(self) -> int:
        """Steps taken (updates committed) in this run: progress.py holds it."""
        return self.progress.step

    @property
    def run_dir(self) -> Path:
        return self.rundir.path

    @property
    def name(self) -> str:
        """The run's name: its directory's name, and the prefix of its Ray actors' names."""
        return self.rundir.name

    @property
    def groups(self) -> dict:
        """role -> WorkerGroup (cluster/base.py): the handle on each role's ranks."""
        return self.workers.groups

    @property
    def tokenizer(self):
        return self.prompts.tokenizer

    @property
    def reward_fn(self) -> Callable[..., float]:
        """The reward function the reward workers hold now (set_reward, a branch or a restore change it)."""
        return self.workers.reward_fn

    @property
    def history(self) -> list[dict]:
        """One metrics row per training step (with its "step")."""
        return self.metrics.history

    @property
    def evals(self) -> list[dict]:
        """One row per evaluation (with its "step")."""
        return self.metrics.evals

    def on_step(self, fn: Callable[[dict | None], None]) -> Callable[[], None]:
        """Call `fn(row)` after each step's metrics row is written (`fn(None)` after an evaluation or a
        run's end); returns a function that unsubscribes."""
        return self.metrics.on_step(fn)

    @contextmanager
    def _phase(self, what: str, changes_state: bool = False, repairs: bool = False):
        """guard.phase, after checking that this session still owns its run (rundir.Lease)."""
        if self.state != "closed":
            self.lease.check(what)
        with self.guard.phase(what, changes_state, repairs):
            yield

    # ---- phases ---------------------------------------------------------------------------------
    def rollout(self, rows: list[dict] | None = None) -> Batch:
        """Generate `rollout.n` responses for each of the next `data.batch_size` training prompts (or `rows`)."""
        with self._phase("rollout"):
            return self._collect_rollout(self._submit_rollout(rows))

    def start_rollout(self, rows: list[dict] | None = None) -> StartedRollout:
        """`rollout()` in two halves, so other work can run while the engine generates (runner.py's async
        steps): this starts it, `finish_rollout(started)` returns its batch, `discard_rollout` drops it."""
        with self._phase("rollout"):
            return self._submit_rollout(rows)

    def _submit_rollout(self, rows: list[dict] | None) -> StartedRollout:
        rows = rows if rows is None else self.prompts.given(rows, "sess.rollout(rows)")  # before any worker runs
        self.workers.catch_up(self.step_count)  # the last push failed after its update: push first
        if rows is None:
            draw = ("train", self.progress.sampler.state_dict())  # the data position: one draw's, whatever came before
            rows = [self.train_data.rows[i] for i in self.progress.sampler.next_indices()]
        else:
            draw = ("rows", self.step_count, [r["prompt"] for r in rows])  # what encode reads
        batch = self.prompts.encode(rows, self.cfg.rollout.n, tag=f"s{self.step_count}")
        return phase_calls.start_rollout(self.workers, batch, self.cfg, self._env_cls, draw)

    def finish_rollout(self, started: StartedRollout) -> Batch:
        with self._phase("rollout"):
            return self._collect_rollout(started)

    def _collect_rollout(self, started: StartedRollout) -> Batch:
        return phase_calls.collect_rollout(self.workers, self.prompts, started, self.step_count,
                                           self.cfg.rollout.max_new_tokens)

    def discard_rollout(self, started: StartedRollout) -> None:
        """Wait for a started rollout nobody will use (so its worker is free), ignoring its failure."""
        phase_calls.discard_rollout(self.workers, started)

    def score(self, batch: Batch) -> Batch:
        """Rewards: `scores_B` and per-sample `reward_error` (a failing reward costs its sample, not the
        step). With a critic, also its values (`values_BR`), computed at the same time on its own workers and
        reused by `prepare` while the weights are unchanged. Re-scoring a prepared batch drops its advantages:
        prepare it again."""
        with self._phase("score"):
            return phase_calls.score(self.workers, batch, self.guard.epoch)

    def prepare(self, batch: Batch) -> Batch:
        """Old log-probs (policy), reference log-probs and KL, values (critic), advantages and returns.
        Moves no state: preparing the same batch twice gives the same batch."""
        with self._phase("prepare"):
            return phase_calls.prepare(self.workers, batch, self.cfg, kl_coef=self.progress.kl.value,
                                       epoch=self.guard.epoch, reuse=self._reuses_logprobs())

    def _reuses_logprobs(self) -> bool:
        return phase_calls.reuses_logprobs(self.cfg, self.workers, self.step_count)

    def update(self, batch: Batch) -> dict:
        """Critic and policy optimizer steps on `batch`, then the weights to the rollout engine. Ends the
        step: one metrics row (returned), written everywhere, and the step count moves."""
        if not isinstance(batch, Batch) or "advantages_BR" not in batch:
            raise UsageError("update(batch) needs a prepared batch: call sess.prepare(sess.score(batch)) first")
        if ("old_logprobs_BR" not in batch and not batch.info.get("off_policy")
                and (batch.info.get("logprobs_epoch") != self.guard.epoch or not self._reuses_logprobs())):
            raise UsageError("this batch was prepared to take its old log-probs from the update's forward, and the "
                             "weights or the settings (train.epochs, train.mini_batches, algo.rollout_is, KL) have "
                             "changed since: prepare it again, sess.update(sess.prepare(batch))")
        with self._phase("update", changes_state=True):
            m = dict(batch.info.get("metrics", {}))
            t0 = time.perf_counter()
            self._train(batch, m)
            seconds = time.perf_counter() - t0
            m.update({"time/update_s": seconds, **compute.memory_metrics(self.groups),
                      **compute.throughput(batch, "update", seconds, self.cfg.train.epochs)})
            m["time/step_s"] = compute.step_seconds(m, batch.info.get("wall_start"))
            if "async/staleness" in m:  # a run's async step (runner.py): how busy each side kept the other
                m.update(timeline.idle_fractions(self.groups, batch.info["wall_start"], m["time/step_s"]))
            mismatch_alarm(m, self.cfg.algo.mismatch_alarm, self.step_count)
            self._commit_step(batch, m)
            return m

    def _train(self, batch: Batch, m: dict) -> None:
        """The optimizer steps, then the push, the step counted while the engine loads (_count_step). A trainer
        that fails may have applied part of its step: the session then refuses phases until `resync()`. A push
        that fails after the update still counts the step (the trainers did move), its row written: the engine
        is re-synced before the next rollout."""
        version = self.step_count + 1
        try:
            steps, moved, early = phase_calls.train(self.workers, batch, self.cfg.train, self.step_count,
                                                    self.progress.kl.value, m)
            self.progress.trainer_steps.update(steps)
        except BaseException:
            self.state = "needs_resync"
            raise
        try:  # in the critic's warm-up the policy did not move: nothing to push
            if moved:
                m.update(phase_calls.push(self.workers, early, version, meanwhile=lambda: self._count_step(batch, m)))
            else:
                self._count_step(batch, m)
        except Exception:  # workers.push_failed: the next rollout pushes again first
            if self.state != "needs_resync":  # the step counted, its push failed: the row still written
                self._commit_step(batch, m)
            raise

    def _count_step(self, batch: Batch, m: dict) -> None:
        """The step taken: lease checked, step count and KL controller moved, controller_state.json written, all
        before the row (_commit_step): a controller killed between leaves trainers and record agreeing, one row
        short (killed during the push: attach pushes again, expect_weights)."""
        with self.guard.recording(f"Step {self.step_count + 1}'s update was applied"):
            self.lease.renew()  # first: a session taken over mid-step writes nothing more
            # the KL the update's own forward measured, else prepare's
            with self.progress.committing(m.pop("kl_current", batch.info.get("kl_current")), len(batch)):
                self.rundir.write_state(self.controller_state())

    def _commit_step(self, batch: Batch, m: dict) -> None:
        """The step's row, then its samples file (which costs only itself)."""
        with self.guard.recording(f"Step {self.step_count}'s update was applied"):
            self.metrics.record_step(self.step_count, m)
        try:
            k = self.cfg.run.save_rollouts_every
            if k and self.step_count % k == 0:
                self.rundir.write_rollouts(batch, self.step_count)
                if self.cfg.run.trackers:
                    self.metrics.log_samples(self.step_count, batch.rows())
        finally:
            self.metrics.notify(m)  # once the step is on disk: a subscriber sees only committed steps
            self.skips.observe(self.step_count, m)

    def step(self) -> dict:
        """One iteration: rollout -> score -> prepare -> update. Returns the step's metrics row.

        Interrupted (Ctrl-C) before its update, the step never happened: the data position and the
        rollout's sampling RNG go back to where they were, so a checkpoint saved now resumes exactly."""
        data_position = self.progress.sampler.state_dict()
        try:
            batch = self.prepare(self.score(self.rollout()))
        except KeyboardInterrupt:
            with deferred_interrupts("rewinding the interrupted step"):
                self.progress.sampler.load_state_dict(data_position)
                self.groups["rollout"].call(RolloutWorker.rewind, f"s{self.step_count}")  # this step's draw, if it ran
            raise
        return self.update(batch)

    def sync_weights(self) -> dict:
        """Push the policy's full weights to every rollout rank; bytes and seconds are metrics."""
        with self._phase("sync_weights"):
            return self.workers.sync(self.step_count)

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self, rows: list[dict] | None = None, *, max_new_tokens: int | None = None) -> dict:
        """Greedy decoding on the held-out prompts, up to `max_new_tokens` (default rollout's), the responses saved
        in rollouts/eval_step_N.jsonl; `eval/accuracy` is the share scoring the maximum 1.0. With an
        environment (env.fn), greedy episodes scored by it; `eval/tool_use`: the share that called a tool."""
        with self._phase("evaluate"):
            rows = self.test_data.rows if rows is None else self.prompts.given(rows, "sess.evaluate(rows)")
            params = phase_calls.greedy(self.cfg, max_new_tokens, self.task.max_positions)
            batch, result = phase_calls.evaluate(self.workers, self.prompts, rows, params, self._env_cls)
            if batch is not None:
                self.rundir.write_rollouts(batch, self.step_count, "eval_step")
            result = {"step": self.step_count, **result}
            self.metrics.log_eval(result)
            return result

    # ---- runs -----------------------------------------------------------------------------------
    # one binding a line: the docs site (griffe) documents each as a method of Session
    run = runner.run  # the four phases in a loop, and the background run's buttons: runner.py
    pause = runner.pause
    resume = runner.resume
    stop = runner.stop

    # ---- the research loop's doors: methods written in whatif.py ----------------------------------
    set_reward = whatif.set_reward
    reward = whatif.set_reward  # as a decorator: @sess.reward
    set_env = whatif.set_env
    advantage = whatif.advantage
    policy_loss = whatif.policy_loss
    configure = whatif.configure
    apply_config = whatif.apply_config
    snapshot = whatif.snapshot
    restore = whatif.restore
    branch = whatif.branch
    fork = whatif.fork
    adopt = whatif.adopt
    replay = whatif.replay
    compare = whatif.compare
    doctor = whatif.doctor

    # ---- workers --------------------------------------------------------------------------------
    def restart(self, *roles: str) -> Session:
        """Rebuild roles' workers (e.g. after a process died). Trainer roles come back from the latest
        checkpoint, and the whole session returns to that checkpoint's step so every role agrees."""
        trainers = [r for r in roles if r in ("policy", "critic")]
        if trainers and not (self.rundir.checkpoints / "latest").exists():
            raise checkpoint.CheckpointError(
                f"cannot restart '{trainers[0]}': no checkpoint in {self.rundir.checkpoints} to restore its "
                "weights from; save regularly (run.checkpoint_every) or start a new session")
        with self._phase("restart", changes_state=True, repairs=bool(trainers)):
            rebuilt = self.workers.restart(*roles)  # on the current config, with the losses shipped from cells
            if trainers:
                checkpoint.restore(self, checkpoint.resolve(self.run_dir))
            elif "rollout" in rebuilt:
                self.workers.sync(self.step_count)
        return self

    def resync(self) -> Session:
        """After an update that was abandoned (Ctrl-C twice) or failed half-way: return every role to the
        latest checkpoint."""
        return self.load()

    # ---- checkpoints (checkpoint.py) --------------------------------------------------------------
    def save(self, name: str | None = None) -> Path:
        """A checkpoint in `RUN_DIR/checkpoints/<name>` (default `step_<N>`) that resumes exactly."""
        with self._phase("save"):
            return checkpoint.save(self, f"step_{self.step_count}" if name is None else name)

    def _load_into(self, name: str | Path | None = None) -> Session:
        """Restore this session to a checkpoint: a name in this run, a folder, or (None) the latest."""
        with self._phase("load", changes_state=True, repairs=True):
            checkpoint.restore(self, checkpoint.resolve(checkpoint.locate(self.run_dir, name)))
        return self

    @classmethod
    def _load_new(cls, path: str | Path, run_dir: str | Path | None = None, overrides=(), *,
                  take_over: bool = False) -> Session:
        """A new session from a checkpoint folder or a run directory (its latest checkpoint). It writes into
        `run_dir` when given, else into the run directory the checkpoint belongs to (refused while another
        live session writes that run, unless `take_over`)."""
        path = checkpoint.resolve(Path(path))
        cfg = Config.load(path / "config.yaml", overrides)
        checkpoint.check_config(path, cfg)  # an override that does not fit its weights: refused before any write
        sess = cls(cfg, run_dir=Path(run_dir) if run_dir else path.parent.parent, take_over=take_over)
        try:
            checkpoint.restore(sess, path)
        except BaseException:
            sess.close()
            raise
        return sess

    load = _hybridmethod(_load_new, _load_into)

    def controller_state(self) -> dict:
        """What the controller itself holds (the workers hold the rest): saved with every checkpoint and
        after every step (controller_state.json, read by `attach`)."""
        return {**self.progress.state_dict(), "evals": self.evals, "run_dir": str(self.run_dir)}

    def load_controller_state(self, state: dict, metrics: bool = True) -> None:
        """`metrics`: also align the metrics log (rows past the step move aside); a branch returning to the
        main line, whose rows went elsewhere, passes False."""
        self.progress.load_state_dict(state)
        if metrics:
            self.metrics.restore(self.step_count, state["evals"])

    def return_to(self, state: dict, metrics: bool = True) -> None:
        """The closing steps of every way back (a checkpoint, a snapshot, a branch's end): the controller's
        state, the engine onto the trainers' weights, and on the main line controller_state.json, so a
        controller killed next re-attaches where the session now is. Not by a session taken over since: it
        no longer writes the run. A write that fails leaves the session `needs_resync` (guard.recording)."""
        # the workers are back already: refused until the files say so too
        with self.guard.recording(f"The workers returned to step {state['step']}", "do the same again (restore, "
                                  "load or adopt), or sess.resync() for the latest checkpoint"):
            self.load_controller_state(state, metrics)  # metric rows past the step move aside: a write
            try:
                self.workers.sync(version=self.step_count)
            finally:  # a failed push is caught up at the next one; the file follows the controller regardless
                if self.current_branch is None and self.lease.holds(reread=True):
                    self.rundir.write_state(self.controller_state())

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop this session's workers (and an embedded Ray it started). Files stay. A background run stops
        first, once the step under way is done and recorded."""
        if self.state == "closed":
            return
        if self.background is not None and not self.background.done:
            self.background.stop_and_wait()  # the step under way ends first
        try:  # a metrics file that cannot be flushed (a full disk) still stops the workers and frees the run
            if hasattr(self, "metrics"):
                self.metrics.close()
        finally:
            if hasattr(self, "workers"):
                for key in self.workers.held_snapshots:  # snapshots' files (their memory goes with the workers)
                    shutil.rmtree(self.run_dir / "snapshots" / key, ignore_errors=True)
                self.workers.close()
            cluster.disconnect(self.cfg)
            if hasattr(self, "lease"):
                self.lease.release()
            self.state = "closed"
        if hasattr(self, "metrics"):
            self.metrics.notify(None)  # views say so

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- display: methods written in views.py ---------------------------------------------------
    dashboard = views.dashboard
    inspect = views.inspect
    serve_tinker = views.serve_tinker
    __repr__ = views.describe
    _repr_html_ = views.describe_html
