"""The Tinker API's futures: a request is accepted at once with an id, done in order on one worker thread, and its
result fetched with `retrieve_future`, which waits (long-polls) for it. One thread does every request, so the
session's workers see one call at a time, in the order clients sent them.

    futures = Futures()
    rid = futures.submit(lambda: work(), key=("model-0", 3))   # the same key again: the same id (a retried submit)
    state, value = futures.wait(rid, timeout=25)               # ("ok", result) / ("error", exception) / None

Requests that can share one call (`batch=(group, item, run_many)`: samples from one sampler with one set of
parameters) and wait next to each other in the queue are done together: `run_many(items)` makes one engine call
for all of them and returns each one's result. rl_loop.py sends a sample request per prompt; the engine then
still generates the whole step's prompts in one batch.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)
KEPT = 10_000     # finished results kept for a retried retrieve; the oldest go first
MAX_TOGETHER = 256  # requests done in one call at most
LINGER_S = 0.005    # how long a batchable request waits for others of its group


@dataclass
class Batchable:
    group: Hashable                              # requests of one group may run together ...
    item: object                                 # ... each contributing its item ...
    run_many: Callable[[list], list]             # ... to one call returning a result (or an exception) per item


class Futures:
    def __init__(self):
        self._jobs: collections.deque = collections.deque()
        self._done: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._known: dict[Hashable, str] = {}
        self._pending: set[str] = set()
        self._waiters: dict[str, list] = {}  # request id -> (event loop, asyncio.Event) of retrieve calls waiting
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="tinker-futures", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object] | None, key: Hashable | None = None,
               batch: Batchable | None = None) -> str:
        with self._cond:
            if key is not None and key in self._known:
                return self._known[key]
            rid = uuid.uuid4().hex
            if key is not None:
                self._known[key] = rid
            self._pending.add(rid)
            self._jobs.append((rid, fn, batch))
            self._cond.notify_all()
        return rid

    def _next(self) -> list | None:
        """The next job, with the batchable jobs of its group queued right behind it. A batchable job waits up to
        LINGER_S for company when nothing else is queued: a client sends a step's sample requests one after the
        other, and the first should not leave alone while the rest are on the wire."""
        with self._cond:
            self._cond.wait_for(lambda: self._jobs or self._closed)
            if not self._jobs:
                return None
            jobs = [self._jobs.popleft()]
            group = jobs[0][2].group if jobs[0][2] is not None else None
            deadline = time.monotonic() + LINGER_S
            while group is not None and len(jobs) < MAX_TOGETHER:
                if self._jobs and self._jobs[0][2] is not None and self._jobs[0][2].group == group:
                    jobs.append(self._jobs.popleft())
                elif not self._jobs and not self._closed and time.monotonic() < deadline:
                    self._cond.wait(deadline - time.monotonic())
                else:
                    break
            return jobs

    def _work(self) -> None:
        while (jobs := self._next()) is not None:
            try:
                if jobs[0][2] is None:
                    results = [("ok", jobs[0][1]())]
                else:
                    results = [("error", r) if isinstance(r, Exception) else ("ok", r)
                               for r in jobs[0][2].run_many([b.item for _, _, b in jobs])]
            except BaseException as e:  # the client gets it as its request's failure; the server goes on
                log.info("tinker request %s failed: %s", jobs[0][0], e)
                results = [("error", e)] * len(jobs)
            with self._cond:
                for (rid, _, _), result in zip(jobs, results):
                    self._pending.discard(rid)
                    self._done[rid] = result
                    for loop, event in self._waiters.pop(rid, []):
                        loop.call_soon_threadsafe(event.set)
                while len(self._done) > KEPT:
                    self._done.popitem(last=False)
                self._cond.notify_all()

    def known(self, rid: str) -> bool:
        with self._cond:
            return rid in self._pending or rid in self._done

    def wait(self, rid: str, timeout: float) -> tuple | None:
        """The finished request's ("ok", value) or ("error", exception); None when it is still running."""
        with self._cond:
            self._cond.wait_for(lambda: rid in self._done, timeout)
            return self._done.get(rid)

    async def wait_async(self, rid: str, timeout: float) -> tuple | None:
        """`wait` for an event loop: no thread is held while the request runs (a client may poll hundreds)."""
        import asyncio
        event = asyncio.Event()
        with self._cond:
            if rid in self._done:
                return self._done[rid]
            self._waiters.setdefault(rid, []).append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        with self._cond:
            waiting = self._waiters.get(rid, [])
            self._waiters[rid] = [w for w in waiting if w[1] is not event]
            if not self._waiters[rid]:
                self._waiters.pop(rid)
            return self._done.get(rid)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
