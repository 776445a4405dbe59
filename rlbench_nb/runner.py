"""The training loop around the phases: `run_loop` is what `sess.run()`, `rlbench-nb train` and exported
scripts all run, in the foreground or, with `background=True`, in a worker thread under an asyncio task
on the kernel's loop (the kernel stays free for other cells and widget clicks).

Per step: rollout -> score -> prepare -> update (with `async_rollout`, the next batches, up to
`max_staleness` of them, are generated while this one trains), then the cadence — evaluation,
checkpoint, rollout files — and finally summary.json.
`RunControl` is checked at every step boundary: pause, resume and stop never cut a phase in half.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .cluster.errors import WorkerError
from .errors import BackgroundRunError, SessionStateError, UsageError, is_count

if TYPE_CHECKING:
    from .phase_calls import StartedRollout
    from .session import Session

log = logging.getLogger(__name__)

MAX_RESTORES = 3  # on_failure="restore": rebuilds in a row without getting past the step that failed


class RunControl:
    """Pause / resume / stop flags a loop checks at step boundaries."""

    def __init__(self):
        self._go = threading.Event()
        self._go.set()
        self.stopped = False

    def pause(self) -> None:
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self.stopped = True
        self._go.set()

    @property
    def paused(self) -> bool:
        return not self._go.is_set()

    def proceed(self) -> bool:
        """Block while paused; False once stopped."""
        self._go.wait()
        return not self.stopped


def check_run_args(cfg, async_rollout: bool, max_staleness, on_failure: str, steps=None) -> None:
    """`Session.run`'s arguments, refused before anything runs."""
    if steps is not None and not is_count(steps):
        raise UsageError(f"steps={steps!r}: a whole number of steps to take past this one, 0 or more (None: "
                         f"run.steps, {cfg.run.steps})")
    if on_failure not in ("raise", "restore"):
        raise UsageError(f"on_failure={on_failure!r}: use 'raise' or 'restore'")
    if not is_count(max_staleness):
        raise UsageError(f"max_staleness={max_staleness!r}: a whole number of steps, 0 or more (0: synchronous)")
    if async_rollout and cfg.algo.rollout_is != "off":
        raise UsageError(f"async_rollout with algo.rollout_is={cfg.algo.rollout_is}: an async step's PPO ratio is "
                         "already against the engine's own log-probs (the policy that sampled), so there is no "
                         "second correction to make and it would not be applied: set algo.rollout_is=off, or run "
                         "without async_rollout")
    if async_rollout and cfg.rollout.engine == "vllm" and cfg.rollout.truncates:
        raise UsageError(f"async_rollout with rollout.engine=vllm and rollout.top_p={cfg.rollout.top_p} / top_k="
                         f"{cfg.rollout.top_k}: an async step's old log-probs are the engine's, which vLLM gives "
                         "after the cut (renormalised), so the PPO ratio would start below 1 on every token: set "
                         "rollout.top_p=1 and rollout.top_k=0, or use rollout.engine=hf")
    if async_rollout and cfg.rollout.colocate:
        raise UsageError("async_rollout overlaps generation with the update, but rollout.colocate runs the "
                         "rollout engine on the trainers' devices (under Ray, in the policy's processes), "
                         "asleep during updates: turn one of them off")


def run(sess: Session, steps: int | None = None, *, progress: bool = True, async_rollout: bool = False,
        max_staleness: int = 1, background: bool = False, on_failure: str = "raise"):
    """`sess.run(...)`: `steps` iterations (default run.steps) with a progress bar; held-out accuracy before
    and after.

    With `async_rollout=True` the next batch is generated while this one is scored, prepared and
    trained on (one step off-policy; the loss's importance ratio uses the generating policy's
    log-probs). `max_staleness=k` keeps up to k batches generating ahead (each trained on at most k steps
    after the weights that generated it: `async/staleness` in the metrics, with `async/rollout_idle` and
    `async/trainer_idle`); 0 is the synchronous loop itself. Under the `local` backend there is nothing to
    overlap with, so it only changes which weights generate. Writes `summary.json` into the run
    directory and returns it.

    With `background=True` (in a Jupyter kernel) the same loop runs in a worker thread and this returns
    a `BackgroundRun` at once: the kernel stays free, `sess.pause()` / `resume()` / `stop()` (or the
    dashboard's buttons) act at the next step boundary, never mid-update; `await run` gives the summary.
    Other cells may look at the session but not step it until the run ends.

    `on_failure="restore"`: when a worker process dies or stops answering, its role is rebuilt
    (`restart`: trainer roles come back from the latest checkpoint, and the session with them) and the
    run goes on until it has done `steps` steps past where it started; an evaluation or save the
    failure cut runs again. A fault that comes back 3 times before the run gets past it is raised.
    Metric rows past the restored step move to metrics.superseded.jsonl; no checkpoint is touched.
    """
    check_run_args(sess.cfg, async_rollout, max_staleness, on_failure, steps)
    if sess.background is not None:
        sess.background.raise_error()  # a background run's failure surfaces at the next run()
    sess.guard.check("run")  # closed, needs re-sync, or another run's: said before the state says "running"
    steps = sess.cfg.run.steps if steps is None else steps
    if background:
        return BackgroundRun.start(sess, steps, async_rollout=async_rollout, max_staleness=max_staleness,
                                   on_failure=on_failure)
    sess.state, sess.progress.run_outcome = "running", "failed"
    try:
        summary = run_loop(sess, steps, async_rollout=async_rollout, max_staleness=max_staleness,
                           on_failure=on_failure, progress=progress)
        sess.progress.run_outcome = "finished"
    except KeyboardInterrupt:
        sess.progress.run_outcome = "stopped"
        raise
    finally:
        if sess.state == "running":
            sess.state = "ready"
        sess.progress.run_end_step = sess.step_count
        sess.metrics.notify(None)  # views redraw with the end state
    return summary


def pause(sess: Session) -> None:
    """Pause the background run at the next step boundary."""
    if sess.background:
        sess.background.pause()


def resume(sess: Session) -> None:
    if sess.background:
        sess.background.resume()


def stop(sess: Session) -> None:
    """Stop the background run at the next step boundary (it still writes its summary and checkpoint)."""
    if sess.background:
        sess.background.stop()


def run_loop(sess: Session, steps: int, *, async_rollout: bool = False, max_staleness: int = 1,
             on_failure: str = "raise", control: RunControl | None = None, progress: bool = True) -> dict:
    """Train for `steps` steps past the session's current step; evaluate before (once per session) and
    after; write summary.json and return it. See `Session.run` for the options."""
    from tqdm.auto import tqdm
    ahead = max_staleness if async_rollout else 0  # rollouts queued ahead of the step being trained
    t0 = time.time()
    start, target, restores, failed_at = sess.step_count, sess.step_count + steps, 0, -1
    sess.progress.run_target = target  # the dashboard's "step / total" and ETA
    before = sess.evals[0] if sess.evals else sess.evaluate()
    bar = tqdm(total=steps, desc="train", disable=not progress, dynamic_ncols=True)
    pending: deque = deque()  # async: the next batches' rollouts, started before this step's update
    try:
        while True:  # until done; a worker failure anywhere (step, evaluation, save) restores and goes on
            try:
                _catch_up(sess, start)  # what a restore interrupted: this step's evaluation or checkpoint
                while sess.step_count < target and (control is None or control.proceed()):
                    row = _one_step(sess, pending, ahead, target)
                    bar.update(1)
                    bar.set_postfix(reward=f"{row['reward/mean']:.3f}", step_s=f"{row['time/step_s']:.2f}")
                    _catch_up(sess, start)
                after = sess.evals[-1] if sess.evals and sess.evals[-1]["step"] == sess.step_count else sess.evaluate()
                # not again when the cadence just saved it; a branch keeps its end state in memory (branches.py)
                if sess.current_branch is None and sess.progress.last_saved_step != sess.step_count:
                    sess.save(f"step_{sess.step_count}")
                break
            except WorkerError as e:
                if sess.step_count > failed_at:  # got past the last failure: a new fault, a fresh budget
                    restores = 0
                if on_failure != "restore" or restores >= MAX_RESTORES:
                    raise
                restores, failed_at = restores + 1, max(failed_at, sess.step_count)
                _discard(sess, pending)  # in-flight rollouts belong to the failed state
                _restore_after(sess, e)
                bar.n = max(0, sess.step_count - start)
                bar.refresh()
    finally:
        bar.close()
        _discard(sess, pending)  # rollouts queued for steps that will not come
    summary = _summary(sess, before, after, time.time() - t0, sess.step_count - start)
    summary.update(target=target, stopped=bool(control is not None and control.stopped))
    sess.rundir.write_summary(summary)
    return summary


@dataclass
class _Ahead:
    """A rollout started ahead of the step that trains on it."""
    started: StartedRollout  # Session.start_rollout's
    version: int             # the policy's step count when it was queued: its weights generate it
    data_position: dict      # the sampler before its draw (a discarded rollout gives its prompts back)


def _one_step(sess: Session, pending: deque, ahead: int, target: int) -> dict:
    """One step. With `ahead` = k > 0 (async_rollout, max_staleness=k), up to k rollouts are kept queued
    before this step's update: the rollout engine runs them in order, each with the weights pushed before
    it was queued, so a batch is trained on at most k steps after the weights that generated it."""
    if not ahead:
        return sess.step()
    t_step = time.perf_counter()
    if not pending:
        pending.append(_start(sess))
    this = pending.popleft()
    try:
        batch = sess.finish_rollout(this.started)
        batch.info.update(off_policy=True, wall_start=t_step)
        batch.info["metrics"]["async/staleness"] = float(sess.step_count - this.version)
        while len(pending) < ahead and sess.step_count + 1 + len(pending) < target:
            pending.append(_start(sess))  # queued before this update's weight push: generated with older weights
        batch = sess.prepare(sess.score(batch))
    except KeyboardInterrupt:  # this step never happened: its prompts, and those queued after, come next
        _discard(sess, pending)
        sess.progress.sampler.load_state_dict(this.data_position)
        raise
    return sess.update(batch)


def _start(sess: Session) -> _Ahead:
    position = sess.progress.sampler.state_dict()
    try:
        return _Ahead(sess.start_rollout(), sess.step_count, position)
    except KeyboardInterrupt:  # held until the draw was made (phases end first): give its prompts back
        sess.progress.sampler.load_state_dict(position)
        raise


def _discard(sess: Session, pending: deque) -> None:
    """Let queued rollouts finish quietly (their workers free again) and give their prompts back to the data
    order: the next rollout draws what the first of them drew."""
    if pending:
        sess.progress.sampler.load_state_dict(pending[0].data_position)
    while pending:
        sess.discard_rollout(pending.popleft().started)


def _catch_up(sess: Session, start: int) -> None:
    """The cadence at the current step — evaluation every `run.eval_every`, checkpoint every
    `run.checkpoint_every` — unless already done: after a restore, a failed evaluation or save runs again."""
    step, run = sess.step_count, sess.cfg.run
    if step == start:
        return  # the step the run began at: evaluated just before, and saved already if it was due
    if run.eval_every and step % run.eval_every == 0 and (not sess.evals or sess.evals[-1]["step"] != step):
        sess.evaluate()
    # a branch saves none: it keeps its end state in memory for adopt (branches.py)
    if (run.checkpoint_every and step % run.checkpoint_every == 0 and sess.progress.last_saved_step != step
            and sess.current_branch is None):
        sess.save(f"step_{step}")


def _restore_after(sess: Session, error: WorkerError) -> None:
    """on_failure='restore': rebuild every role with a dead rank (or the role that stopped answering)."""
    roles = [r for r, g in sess.groups.items() if g.dead_ranks()] or [error.role]
    log.warning("step %d: %s — restarting %s (on_failure='restore')", sess.step_count + 1,
                str(error).splitlines()[0], ", ".join(roles))
    sess.restart(*roles)


def _summary(sess: Session, before: dict, after: dict, wall_s: float, steps: int) -> dict:
    rewards = [r["reward/mean"] for r in sess.history if "reward/mean" in r]
    k = max(1, min(10, len(rewards) // 4 or 1))  # first and last 10 steps, fewer on short runs
    return {
        "run_dir": str(sess.run_dir), "steps": sess.step_count, "steps_this_run": steps,
        "wall_s": round(wall_s, 1),
        "accuracy_before": before["eval/accuracy"], "accuracy_after": after["eval/accuracy"],
        "accuracy_gain": after["eval/accuracy"] - before["eval/accuracy"],
        "eval_prompts": after["eval/n"],
        # the held-out answers' length and each part of a combined reward (the share in the asked format)
        "eval_before_after": {k.removeprefix("eval/"): [before[k], after[k]] for k in after
                              if k in before and (k.startswith("eval/part/") or k == "eval/response_len")},
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "final_metrics": sess.history[-1] if sess.history else {},
    }


class BackgroundRun:
    """Handle on a run started with `sess.run(..., background=True)`; `await run` gives its summary.

    The loop runs in a worker thread; the session refuses phases from any other thread until it ends
    (they would interleave with the run's). A failure is kept, shown in the dashboard, and raised by the
    session's next `run()` as a `BackgroundRunError` chained to the cause."""

    def __init__(self, session: Session, control: RunControl):
        self.session, self.control = session, control
        self.task: asyncio.Task | None = None
        self.summary: dict | None = None
        self.error: BaseException | None = None  # what the loop raised, if it failed
        self._ended = False  # the loop has returned or raised (the task itself ends a moment later)
        self._error_raised = False
        self._submitted = False  # the loop was handed to a worker thread (which then always runs it)
        self._thread_done = threading.Event()

    @classmethod
    def start(cls, session: Session, steps: int, **options) -> BackgroundRun:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise SessionStateError("run(background=True) needs a running event loop (a Jupyter kernel); "
                                    "in a script call run() without it") from None
        if session.background is not None and not session.background.done:
            raise SessionStateError("a background run is already going: sess.stop() it first")
        run = cls(session, RunControl())
        session.background = run
        run.task = loop.create_task(run._main(steps, options))  # a reference is kept: tasks can vanish
        return run

    async def _main(self, steps: int, options: dict) -> dict | None:
        sess = self.session
        try:
            if not self.control.stopped:  # stopped before it began (a close() in the same cell): nothing runs
                self._submitted = True
                self.summary = await asyncio.to_thread(self._thread_main, steps, options)
        except BaseException as e:  # kept for the dashboard and the next interaction
            self.error = e
        self._ended = True  # before the final redraw, so the dashboard says finished / stopped / failed
        sess.progress.run_outcome, sess.progress.run_end_step = self.state, sess.step_count
        sess.metrics.notify(None)  # final redraw with the end state
        return self.summary

    def _thread_main(self, steps: int, options: dict) -> dict:
        try:
            with self.session.guard.owned_by_this_thread():
                return run_loop(self.session, steps, control=self.control, progress=False, **options)
        finally:
            self._thread_done.set()

    def stop_and_wait(self) -> None:
        """Stop at the next step boundary and wait until the loop's thread has returned (`Session.close`: the
        step under way ends and is recorded, and the run ends "stopped", not failed by closing workers)."""
        self.control.stop()
        if self._submitted and self.session.guard.owner != threading.get_ident():  # not from the loop itself
            self._thread_done.wait()

    def raise_error(self) -> None:
        """Raise the run's failure (once) as a BackgroundRunError chained to it."""
        if self.error is not None and not self._error_raised:
            self._error_raised = True
            err = self.error
            raise BackgroundRunError(f"the background run failed at step {self.session.step_count + 1}: "
                                     f"{type(err).__name__}: {err}", err) from err

    @property
    def done(self) -> bool:
        return self.task is None or self._ended or self.task.done()

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.done:
            return "stopped" if self.control.stopped else "finished"
        return "paused" if self.control.paused else "running"

    def pause(self) -> None:
        self.control.pause()

    def resume(self) -> None:
        self.control.resume()

    def stop(self) -> None:
        self.control.stop()

    def __await__(self):
        return self.task.__await__()

    def __repr__(self) -> str:
        return f"BackgroundRun(state={self.state}, step={self.session.step_count})"
