"""`MetricsLog`: every metric row goes through one object, which fans it out (as tinker-cookbook's
`MultiplexLogger`): the in-memory history and evals the dashboard draws, metrics.jsonl, TensorBoard, the
trackers (W&B, MLflow: metrics/trackers.py), and whoever subscribed with `on_step`.

    log = MetricsLog(run_dir, tensorboard=True, trackers=make_trackers(["mlflow"], run_dir, cfg))
    unsubscribe = log.on_step(lambda row: print(row and row["reward/mean"]))   # None: redraw, no new step
    log.log_step(1, {"reward/mean": 0.5})
    log.log_eval({"step": 1, "eval/accuracy": 0.4, "eval/n": 200})
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from ..errors import RunDirError, write_failure
from .sinks import JSONLSink, TensorBoardSink, read_jsonl

log = logging.getLogger(__name__)

Subscriber = Callable[[dict | None], None]


class MetricsLog:
    def __init__(self, run_dir: Path, tensorboard: bool, trackers=(), tracker_samples: int = 16):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb_dir = Path(run_dir) / "tb" if tensorboard else None
        self.history: list[dict] = []   # one row per training step, with its "step"
        self.evals: list[dict] = []     # one row per evaluation, with its "step"
        self._subscribers: list[Subscriber] = []
        self._sinks: list = []     # the run directory's files: a failure to write them stops the step
        self._trackers = list(trackers)  # services: one that fails is dropped, training goes on
        self._tracker_samples = tracker_samples
        self._open_files()

    def _open_files(self) -> None:
        self._close_files()
        self._sinks = [JSONLSink(self.path)]
        if self._tb_dir is not None:
            self._sinks.append(TensorBoardSink(self._tb_dir))

    def _close_files(self) -> None:
        for s in self._sinks:
            s.close()
        self._sinks = []

    def close(self) -> None:
        self._close_files()
        for t in self._trackers:
            self._tracker_call(t, "close")
        self._trackers = []

    # ---- writing --------------------------------------------------------------------------------
    def log_step(self, step: int, row: dict) -> None:
        self.record_step(step, row)
        self.notify(row)

    def record_step(self, step: int, row: dict) -> None:
        """`log_step` without telling the subscribers (the session tells them once the step is committed)."""
        self.history.append({"step": step, **row})
        self._write(step, row)

    def log_eval(self, result: dict) -> None:
        self.evals.append(result)
        self._write(result["step"], {k: v for k, v in result.items() if k != "step"})
        self.notify(None)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A table of rollout samples (`Batch.rows()`) to the trackers that take one."""
        if self._tracker_samples:
            for t in list(self._trackers):
                self._tracker_call(t, "write_samples", step, rows, self._tracker_samples)

    def _write(self, step: int, row: dict) -> None:
        for s in self._sinks:
            try:
                s.write(step, row)
            except OSError as e:  # a full disk: say so; the next open mends a torn last line
                raise RunDirError(e.errno, write_failure(self.path, e)) from None
        for t in list(self._trackers):
            self._tracker_call(t, "write", step, row)

    def _tracker_call(self, tracker, method: str, *args) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as e:  # metrics.jsonl is the record; a tracker is a view of it
            log.warning("%s failed in %s (%s: %s): it gets nothing more this session; metrics.jsonl has every row",
                        type(tracker).__name__, method, type(e).__name__, e)
            if tracker in self._trackers:
                self._trackers.remove(tracker)

    # ---- subscribers ----------------------------------------------------------------------------
    def on_step(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(row)` after every step's row is written (`fn(None)`: something else changed, e.g. an
        evaluation or a run's end). Returns a function that unsubscribes. A subscriber that raises is
        logged and kept out of the training loop's way."""
        self._subscribers.append(fn)

        def unsubscribe() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)
        return unsubscribe

    def notify(self, row: dict | None) -> None:
        for fn in list(self._subscribers):
            try:
                fn(row)
            except Exception:  # a broken view must not stop training
                log.exception("metrics subscriber %r failed", fn)

    # ---- resuming -------------------------------------------------------------------------------
    def restore(self, step: int, evals: list[dict]) -> None:
        """Align with a state restored at `step`: rows written after it move to metrics.superseded.jsonl
        (kept, not lost), the history is re-read from the file, and `evals` are the state's own."""
        self._close_files()  # the file is rewritten: reopen after (trackers stay open: their rows past `step` stay)
        self.history = _truncate(self.path, step)
        self.evals = list(evals)
        self._open_files()


def _truncate(metrics_path: Path, step: int) -> list[dict]:
    """Keep rows up to `step` in metrics.jsonl; rows past it move to metrics.superseded.jsonl. Returns the
    kept training rows."""
    rows = read_jsonl(metrics_path)
    keep = [r for r in rows if r.get("step", 0) <= step]
    later = [r for r in rows if r.get("step", 0) > step]
    if later:
        with (metrics_path.parent / "metrics.superseded.jsonl").open("a") as f:
            for r in later:
                f.write(json.dumps(r) + "\n")
        tmp = metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(metrics_path)
    return [r for r in keep if "reward/mean" in r]
