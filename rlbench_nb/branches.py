"""What if: branches, replays and comparisons inside a live session, in seconds.

    with sess.branch("clip-0.28", "algo.clip_high=0.28") as b:   # from here, other settings
        b.run(20)                                                 # steps written to RUN_DIR/branches/clip-0.28
    # the session is back on its main line, exactly where it was (weights, optimizer, RNG, data, step)

    low = sess.fork("lr-1e-4", 20, "train.lr=1e-4")               # the same, as one call
    high = sess.fork("lr-1e-3", 20, "train.lr=1e-3")
    sess.compare(low, high)                                       # curves overlaid, a table of differences
    sess.adopt(high)                                              # keep one: the main line continues from it

    r = sess.replay(batch, "algo.clip_low=0.1")                   # prepare + update on a batch that exists
    r.weight_change                                               # per-parameter relative change

Branches run one after another on the same workers from a snapshot (snapshots.py): no extra memory but
the snapshot. A branch may change anything that keeps the model's shapes and the set of roles: algorithm,
loss, clip, KL coefficient, learning rate, reward, sampling, batch size; not `model`, `task`, `cluster` or
the data files. Its metrics go to its own folder, never into the main line's metrics.jsonl.
"""
from __future__ import annotations

import logging
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import snapshots
from .config import Config, ConfigError
from .data.batch import Batch
from .errors import UsageError, expect
from .guard import deferred_interrupts
from .metrics.log import MetricsLog
from .roles import PolicyWorker
from .rundir import RunDir

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger(__name__)

FIXED_SECTIONS = ("model", "task", "cluster")
FIXED_FIELDS = ("data.train_path", "data.test_path", "data.prompt_key", "data.max_prompt_len",
                "data.chat_template", "data.shuffle", "run.dir", "run.name", "run.seed")


def variant(cfg: Config, overrides, who: str = "a branch") -> Config:
    """`cfg` with a branch's overrides, refused (ConfigError naming the key and `who` asked) where they would
    change the model's shapes, the roles, the cluster or the data."""
    new = cfg.override(*overrides)
    old_d, new_d = cfg.to_dict(), new.to_dict()
    for section in FIXED_SECTIONS:
        if old_d[section] != new_d[section]:
            key = next(f"{section}.{k}" for k in new_d[section] if new_d[section][k] != old_d[section].get(k))
            raise ConfigError(f"{who} cannot change '{key}': it shares this session's workers and model; "
                              "start another session for that")
    for dotted in FIXED_FIELDS:
        section, key = dotted.split(".")
        if old_d[section][key] != new_d[section][key]:
            raise ConfigError(f"{who} cannot change '{dotted}': the run's data position and files are read "
                              "with it (a branch starts from the main line's); start another session for that")
    for role, uses in (("critic", "uses_critic"), ("reference", "uses_reference")):
        if role == "reference" and cfg.model.lora.r:
            continue  # the LoRA policy is its own reference (adapters off): any branch may turn KL on
        if getattr(cfg, uses) != getattr(new, uses):
            need = "need" if getattr(new, uses) else "do not use"
            raise ConfigError(f"{who} asks for settings that {need} a {role} model, and this session "
                              f"{'has' if getattr(cfg, uses) else 'has no'} {role} workers: {who} keeps the "
                              "session's roles (start the session with settings that use the role, e.g. "
                              "algo.kl_coef > 0 for a reference)")
    return new


def branch_dir(run_dir: Path, name: str) -> Path:
    """RUN_DIR/branches/<name>, for a plain folder name (the rules of checkpoint names)."""
    from .checkpoint import CheckpointError, checkpoint_path
    try:
        checkpoint_path(run_dir, name)
    except CheckpointError as e:
        raise UsageError(str(e).replace("checkpoint name", "branch name").replace("'step_100'", "'lr-1e-4'")) from None
    return run_dir / "branches" / name


@dataclass
class Branch:
    """A variant run from the point `start_step` of the main line; its rows, evaluations and end state."""

    name: str
    overrides: tuple[str, ...]
    cfg: Config
    path: Path
    start_step: int
    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    summary: dict | None = None
    end: snapshots.Snapshot | None = None  # its final state, until adopted or released
    _session: Any = field(default=None, repr=False)
    _start: snapshots.Snapshot | None = field(default=None, repr=False)  # the main line, while it runs

    def run(self, steps: int, progress: bool = True, **kw) -> dict:
        """`steps` steps of this branch (inside its `with` block)."""
        if self._session is None or self._session.current_branch is not self:
            raise UsageError(f"branch '{self.name}' has ended: run it inside its `with sess.branch(...)` block, "
                             "or use sess.fork(name, steps, ...)")
        self.summary = self._session.run(steps, progress=progress, **kw)
        return self.summary

    def curve(self, metric: str) -> tuple[list[int], list[float]]:
        rows = self.evals if metric.startswith("eval/") else self.history
        pts = [(r["step"], r[metric]) for r in rows if r.get(metric) is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    def weight_change(self) -> dict[str, float]:
        """Each policy parameter's relative change since the branch started (inside its `with` block)."""
        if self._start is None:
            raise UsageError(f"branch '{self.name}' has ended: its start is no longer held")
        return _weight_change(self._session, self._start.key)

    def release(self) -> None:
        """Free the end state this branch keeps for `adopt`."""
        if self.end is not None:
            self.end.release()
            self.end = None

    def __repr__(self) -> str:
        last = self.history[-1] if self.history else {}
        reward = f", reward {last['reward/mean']:.3f}" if "reward/mean" in last else ""
        return (f"<Branch '{self.name}' {list(self.overrides)}: steps {self.start_step + 1}.."
                f"{self.start_step + len(self.history)}{reward}>")


@dataclass
class Replay:
    """What one update did to a batch that already existed: its metrics row and the weight change."""

    name: str
    overrides: tuple[str, ...]
    row: dict
    weight_change: dict[str, float]  # parameter -> |W_after - W_before| / |W_before|

    def curve(self, metric: str) -> tuple[list[int], list[float]]:
        return ([self.row["step"]], [self.row[metric]]) if self.row.get(metric) is not None else ([], [])

    def largest_changes(self, k: int = 5) -> list[tuple[str, float]]:
        return sorted(self.weight_change.items(), key=lambda kv: -kv[1])[:k]

    def __repr__(self) -> str:
        loss = self.row.get("loss/policy")
        return f"<Replay '{self.name}' {list(self.overrides)}: loss/policy {loss}>"


@contextmanager
def branch(sess: Session, name: str, overrides=(), reward=None, keep: bool = True):
    """Run the block on a variant of the session (see the module's docstring); the main line comes back
    exactly as it was, whatever the block did or raised."""
    if sess.current_branch is not None:
        raise UsageError(f"already inside branch '{sess.current_branch.name}': branches do not nest; end it first")
    if sess.background is not None and not sess.background.done:
        raise UsageError("a background run is stepping this session: stop it before branching")
    cfg = variant(sess.cfg, overrides)
    path = branch_dir(sess.run_dir, name)
    if path.exists():
        log.info("branch '%s' is run again: its earlier folder %s is replaced", name, path)
        shutil.rmtree(path)
    start = snapshots.take(sess)
    main_rundir, main_metrics = sess.rundir, sess.metrics
    progress = sess.progress  # the dashboard's header: the main line's run, back after the branch
    main_run = (progress.run_target, progress.run_outcome, progress.run_end_step)
    b = Branch(name, tuple(overrides), cfg, path, sess.step_count, _session=sess, _start=start)
    try:
        sess.current_branch = b
        sess.apply_config(cfg)
        if reward is not None:
            sess.workers.set_reward(reward)
        sess.rundir = RunDir(path)
        sess.rundir.write_config(cfg)
        sess.metrics = MetricsLog(path, tensorboard=False)
        sess.metrics.evals = list(main_metrics.evals)  # what the branch starts from ("before")
        yield b
    finally:
        if sess.metrics is not main_metrics:  # not when the branch's own folder could not be made
            b.history = list(sess.metrics.history)
            b.evals = [e for e in sess.metrics.evals if e["step"] > b.start_step]
            sess.metrics.close()
        try:
            if keep and sess.step_count > b.start_step and sess.state == "ready":
                b.end = snapshots.take(sess)
        finally:
            with deferred_interrupts("returning to the main line"):  # never left half-way, even on Ctrl-C
                sess.rundir, sess.metrics, sess.current_branch = main_rundir, main_metrics, None
                sess.branches[name] = b
                # also the main config and reward function; a failure (a worker, a write: needs_resync) keeps
                # the start snapshot held, so nothing it alone knew is lost
                snapshots.restore(sess, start, history=False)
                progress.run_target, progress.run_outcome, progress.run_end_step = main_run
                start.release()
                b._start = None


def fork(sess: Session, name: str, steps: int, overrides=(), reward=None, progress: bool = True) -> Branch:
    with branch(sess, name, overrides, reward) as b:
        b.run(steps, progress=progress)
    return b


def adopt(sess: Session, b: Branch) -> None:
    """Continue the main line from the end of branch `b`: its weights, optimizer, RNG, data position and
    settings; its rows join metrics.jsonl (rows the main line wrote after the fork point move to
    metrics.superseded.jsonl)."""
    expect(b, Branch, "sess.adopt(branch)", "a branch from sess.fork(...) or sess.branch(...)")
    if b.end is None or b.end.released:
        raise UsageError(f"branch '{b.name}' kept no end state (it was released, adopted already, or took no "
                         "step)")
    before = [e for e in sess.evals if e["step"] <= b.start_step]
    snapshots.restore(sess, b.end, history=False)
    sess.metrics.restore(b.start_step, before)
    for row in b.history:
        sess.metrics.log_step(row["step"], {k: v for k, v in row.items() if k != "step"})
    for e in b.evals:
        sess.metrics.log_eval(e)
    sess.rundir.write_config(sess.cfg)
    sess.rundir.write_state(sess.controller_state())
    b.release()


def replay(sess: Session, batch: Batch, overrides=(), name: str = "replay") -> Replay:
    """prepare + update on `batch` (scored first if it has no rewards) on a branch with `overrides`; the
    session comes back untouched. Returns the update's metrics and each parameter's relative change."""
    expect(batch, Batch, "sess.replay(batch)", "a batch (sess.rollout(), sess.score(...), rl.load_rollouts(file))")
    with branch(sess, name, overrides, keep=False) as b:
        scored = batch if "scores_B" in batch else sess.score(batch)
        row = {"step": sess.step_count + 1, **sess.update(sess.prepare(scored))}
        change = b.weight_change()  # against the weights the branch started from
    return Replay(b.name, b.overrides, row, change)


def _weight_change(sess: Session, key: str) -> dict[str, float]:
    totals: dict[str, list[float]] = {}
    for part in sess.groups["policy"].call(PolicyWorker.weight_change, key):  # each rank's shards: sum the squares
        for k, (diff, ref) in part.items():
            t = totals.setdefault(k, [0.0, 0.0])
            t[0] += diff
            t[1] += ref
    return {k: (d / r) ** 0.5 if r > 0 else float(d > 0) for k, (d, r) in totals.items()}
