"""The `local` backend: every role in the controller's process (world size 1; pdb works).

The same `WorkerGroup` surface as the Ray backend (cluster/base.py); a "submitted" call has already run
when `submit_*` returns, since there is nothing to overlap it with. Errors come back as `WorkerError`
naming the role, rank and method.
"""
from __future__ import annotations

import os
import time
from typing import Any

from ..data.batch import Batch
from ..metrics.memory import memory_snapshot
from .base import CallRecord, Method, Pending, by_reference
from .errors import WorkerError


class LocalWorkerGroup:
    """One rank of `worker_cls`, constructed in this process."""

    def __init__(self, role: str, worker_cls, *args, **kwargs):
        self.role = role
        self.world_size = 1
        self.records: list[CallRecord] = []
        self.memory: dict[int, dict] = {}
        self.workers = [self._run(0, "__init__", worker_cls, *args, **kwargs)]
        w = self.workers[0]
        self.info = {0: {"pid": os.getpid(), "node": "local", "device": str(getattr(w, "device", "cpu")),
                         "dtype": getattr(w, "dtype", None)}}

    def ready(self) -> LocalWorkerGroup:
        return self  # built in __init__

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

    @by_reference
    def call(self, method: Method, *args, **kwargs) -> list:
        """Call `method` on every rank with the same arguments; a list of results by rank."""
        return [self._run(r, method, getattr(w, method), *args, **kwargs) for r, w in enumerate(self.workers)]

    @by_reference
    def submit(self, method: Method, *args, **kwargs) -> Pending:
        """In-process: runs now; `collect(pending)` returns the results."""
        return Pending(method, self.call(method, *args, **kwargs), time.perf_counter())

    @by_reference
    def call_each(self, method: Method, per_rank_args: list[tuple]) -> list:
        """Rank r gets `per_rank_args[r]`."""
        return [self._run(r, method, getattr(w, method), *a)
                for r, (w, a) in enumerate(zip(self.workers, per_rank_args))]

    @by_reference
    def submit_stored(self, method: Method, *args, to=None, **kwargs) -> Pending:
        """In-process: runs now; the results are `pending.stored`, and `collect(pending)` gives them too."""
        results = self.call(method, *args, **kwargs)
        return Pending(method, results, time.perf_counter(), stored=results)

    @by_reference
    def call_rank0(self, method: Method, *args, **kwargs) -> Any:
        return self._run(0, method, getattr(self.workers[0], method), *args, **kwargs)

    @by_reference
    def call_shards(self, method: Method, batch: Batch, *args, **kwargs) -> list:
        """Split `batch` by data-parallel rank and call each rank on its part; results by rank."""
        parts = batch.chunk(self.world_size)
        return [self._run(r, method, getattr(w, method), p, *args, **kwargs)
                for r, (w, p) in enumerate(zip(self.workers, parts))]

    @by_reference
    def submit_shards(self, method: Method, batch: Batch, *args, **kwargs) -> Pending:
        """In-process there is nothing to overlap with: runs now; `collect` returns the results."""
        return Pending(method, self.call_shards(method, batch, *args, **kwargs), time.perf_counter())

    def collect(self, pending: Pending) -> list:
        return pending.handles

    def send_held(self) -> None:
        """Nothing is ever held here: a call runs when it is made."""

    @by_reference
    def call_split(self, method: Method, batch: Batch, *args, **kwargs) -> Batch:
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
