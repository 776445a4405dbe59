"""Errors from workers, told the way a person debugs them: role, rank, method, the user's failing line."""
from __future__ import annotations

import os
import traceback
import types

from ..errors import RLBenchError

# Frames under these folders are libraries, not "the user's line".
_LIBRARY_MARKERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}", f"{os.sep}lib{os.sep}python3")


def user_frame(tb: types.TracebackType | None) -> str | None:
    """'file:line: source' of the deepest frame outside installed libraries, or None.

    A frame whose line is itself a `raise` (a validation helper) yields to its caller: the caller's
    line is the one to look at."""
    frames = [f for f in traceback.extract_tb(tb)
              if not any(m in f.filename for m in _LIBRARY_MARKERS) or "rlbench_nb" in f.filename]
    if not frames:
        return None
    best = frames[-1]
    if (best.line or "").lstrip().startswith("raise ") and len(frames) > 1:
        best = frames[-2]
    return f"{best.filename}:{best.lineno}: {(best.line or '').strip()}"


_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "killed due to memory pressure")
OOM_KNOBS = ("lower data.batch_size, rollout.n, train.micro_batch_size, rollout.micro_batch_size or "
             "rollout.max_new_tokens; on a GPU also model.dtype=bfloat16 and train.activation_checkpointing=true")


def is_out_of_memory(error: BaseException | str) -> bool:
    """torch's CPU/CUDA allocator failures, Python's MemoryError, and Ray's OOM-killer message."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    return any(m in str(error).lower() for m in _OOM_MARKERS)


def memory_had() -> str:
    """What this process held when it ran out: resident and peak memory, and the GPU's when there is one."""
    from ..metrics.memory import memory_snapshot
    m = memory_snapshot()
    text = f"{m.get('rss_gb', 0.0):.2f} GB resident, {m['peak_rss_gb']:.2f} GB peak"
    if "gpu_alloc_gb" in m:
        text += f", GPU {m['gpu_alloc_gb']:.2f} GB allocated, {m['gpu_peak_gb']:.2f} GB peak"
    return text


class ClusterError(RLBenchError, RuntimeError):
    """The cluster cannot be reached, or cannot hold what the config asks for."""


class WorkerError(RLBenchError, RuntimeError):
    """A worker call failed. `role`, `rank`, `method` say where; `frame` is the failing user line;
    `remote_traceback` is the full traceback from the worker's process (also for Ray actors)."""

    def __init__(self, role: str, rank: int, method: str, summary: str, frame: str | None = None,
                 remote_traceback: str = ""):
        self.role, self.rank, self.method, self.summary = role, rank, method, summary
        self.frame, self.remote_traceback = frame, remote_traceback
        where = f"\n  at {frame}" if frame else ""
        super().__init__(f"{role} rank {rank} failed in {method}(): {summary}{where}")

    def __reduce__(self):  # type(self): a WorkerDiedError stays one across processes
        return (type(self), (self.role, self.rank, self.method, self.summary, self.frame, self.remote_traceback))

    @classmethod
    def from_exception(cls, role: str, rank: int, method: str, error: BaseException) -> WorkerError:
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        summary = f"{type(error).__name__}: {error}"
        if is_out_of_memory(error):  # measured here, in the process that ran out
            summary = (f"out of memory (the process had {memory_had()}): {type(error).__name__}: "
                       f"{str(error)[:300]} — {OOM_KNOBS}")
        return cls(role, rank, method, summary, user_frame(error.__traceback__), tb)


class WorkerDiedError(WorkerError):
    """The worker's process is gone (killed, out of memory, crashed)."""


class WeightSyncError(WorkerError):
    """A rollout rank does not hold the weights just pushed to it (the load was skipped, or went into a
    copy the engine does not use): found by comparing fingerprints after the push."""
