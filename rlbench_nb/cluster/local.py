"""The `local` backend: every role in the controller's process (world size 1; pdb works).

`WorkerGroup` is the controller's only handle on a role: N ranks of one worker class, with dispatch
(broadcast, split-by-rank-and-concatenate, rank 0) and a record of each call for the phase timeline.
Errors come back as `WorkerError` naming the role, rank and method.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from ..data.batch import Batch
from ..metrics.memory import memory_snapshot
from .errors import WorkerError


@dataclass
class CallRecord:
    role: str
    rank: int
    method: str
    start: float     # controller clock: the call was made ...
    end: float       # ... and its result was back
    work_s: float    # seconds inside the worker's method; end - start - work_s is the dispatch overhead


class LocalWorkerGroup:
    """One rank of `worker_cls`, constructed in this process."""

    def __init__(self, role: str, worker_cls, *args, **kwargs):
        self.role = role
        self.world_size = 1
        self.records: list[CallRecord] = []
        self.memory: dict[int, dict] = {}
        self.workers = [self._run(0, "__init__", worker_cls, *args, **kwargs)]
        self.info = {0: {"pid": os.getpid(), "node": "local", "device": str(getattr(self.workers[0], "device", "cpu"))}}

    def _run(self, rank: int, method: str, fn, *args, **kwargs) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise WorkerError.from_exception(self.role, rank, method, e) from e
        finally:
            end = time.perf_counter()
            self.records.append(CallRecord(self.role, rank, method, start, end, end - start))
            del self.records[:-1000]  # bounded: the timeline shows recent steps only
            self.memory[rank] = memory_snapshot()  # like the Ray backend: every call reports memory

    def call(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every rank with the same arguments; a list of results by rank."""
        return [self._run(r, method, getattr(w, method), *args, **kwargs) for r, w in enumerate(self.workers)]

    def submit(self, method: str, *args, **kwargs) -> list:
        """In-process: runs now; `collect(handle)` returns the results."""
        return self.call(method, *args, **kwargs)

    def call_each(self, method: str, per_rank_args: list[tuple]) -> list:
        """Rank r gets `per_rank_args[r]`."""
        return [self._run(r, method, getattr(w, method), *a) for r, (w, a) in enumerate(zip(self.workers, per_rank_args))]

    def submit_stored(self, method: str, *args, to=None, **kwargs) -> list:
        """In-process: runs now; `stored(handle)` are the results, `collect(handle)` too."""
        return self.call(method, *args, **kwargs)

    @staticmethod
    def stored(handle: list) -> list:
        return handle

    def call_rank0(self, method: str, *args, **kwargs) -> Any:
        return self._run(0, method, getattr(self.workers[0], method), *args, **kwargs)

    def call_shards(self, method: str, batch: Batch, *args, **kwargs) -> list:
        """Split `batch` by data-parallel rank and call each rank on its part; results by rank."""
        parts = batch.chunk(self.world_size)
        return [self._run(r, method, getattr(w, method), p, *args, **kwargs)
                for r, (w, p) in enumerate(zip(self.workers, parts))]

    def submit_shards(self, method: str, batch: Batch, *args, **kwargs) -> list:
        """In-process there is nothing to overlap with: runs now; `collect` returns the results."""
        return self.call_shards(method, batch, *args, **kwargs)

    def collect(self, handle: list) -> list:
        return handle

    def call_split(self, method: str, batch: Batch, *args, **kwargs) -> Batch:
        """`call_shards`, with the ranks' result batches concatenated back in order."""
        return Batch.cat(self.call_shards(method, batch, *args, **kwargs))

    def dead_ranks(self) -> list[int]:
        return []  # in this process: if it died, so did the controller

    def close(self) -> None:
        for w in self.workers:  # engines with processes of their own (vLLM) stop them
            if hasattr(w, "close"):
                try:
                    w.close()
                except Exception:
                    pass
        self.workers.clear()
