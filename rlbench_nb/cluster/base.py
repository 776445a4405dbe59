"""What the controller may ask of a role's workers, whichever backend runs them.

A `WorkerGroup` is N ranks of one worker class. Dispatch comes in three shapes: the same arguments to
every rank (`call`), a batch split by data-parallel rank (`call_shards` / `call_split`), and per-rank
arguments (`call_each`). Each has a `submit_*` twin that starts the calls and returns a `Pending`;
`collect(pending)` waits for them, so two roles can work at once. Every call leaves a `CallRecord` (the
phase timeline) and the rank's memory snapshot.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..data.batch import Batch

# A worker method, by reference (`PolicyWorker.update`: go-to-definition follows a phase into the worker)
# or by name; the wire carries the name.
Method = str | Callable


def method_name(method: Method) -> str:
    return method if isinstance(method, str) else method.__name__


def by_reference(dispatch):
    """A group's dispatch method taking its worker method as a `Method`: the name goes on."""
    @functools.wraps(dispatch)
    def wrapper(self, method: Method, *args, **kwargs):
        return dispatch(self, method_name(method), *args, **kwargs)
    return wrapper


@dataclass
class CallRecord:
    role: str
    rank: int
    method: str
    start: float     # controller clock: the call was made ...
    end: float       # ... and its result was back
    work_s: float    # seconds inside the worker's method; end - start - work_s is the dispatch overhead


@dataclass
class Pending:
    """Calls started on every rank of a group, not yet collected. `handles` are the ranks' results (the
    local backend has run them already) or Ray object references; `stored` are references to results
    left where they were made (`submit_stored`), to pass to another role's call without a round trip."""
    method: str
    handles: list
    start: float
    stored: list = field(default_factory=list)


class WorkerGroup(Protocol):
    role: str
    world_size: int
    records: list[CallRecord]
    memory: dict[int, dict]   # rank -> last memory snapshot
    info: dict[int, dict]     # rank -> pid, node, device

    def ready(self) -> WorkerGroup: ...  # wait until every rank's worker is built
    def call(self, method: Method, *args, **kwargs) -> list: ...
    def submit(self, method: Method, *args, **kwargs) -> Pending: ...
    def call_each(self, method: Method, per_rank_args: list[tuple]) -> list: ...
    def call_rank0(self, method: Method, *args, **kwargs) -> Any: ...
    def call_shards(self, method: Method, batch: Batch, *args, **kwargs) -> list: ...
    def submit_shards(self, method: Method, batch: Batch, *args, **kwargs) -> Pending: ...
    def call_split(self, method: Method, batch: Batch, *args, **kwargs) -> Batch: ...
    def submit_stored(self, method: Method, *args, to: WorkerGroup | None = None, **kwargs) -> Pending: ...
    def collect(self, pending: Pending) -> list: ...
    def send_held(self) -> None: ...  # calls waiting on another call's result that is in now: on their way
    def dead_ranks(self) -> list[int]: ...
    def close(self) -> None: ...


def finish_all(work, *started: tuple | None) -> tuple:
    """`work()`, then each started (group, pending) call collected once: (work's result, [each call's results,
    None for a None]). After a failure the other calls are still waited for (no worker is left busy with a
    call nobody collects) — but not those of a group that already failed (they queue behind its hung or broken
    call), and none after an interrupt. The first failure is raised after that."""
    failure, result, failed = None, None, set()
    try:
        result = work()
    except BaseException as e:
        failure = e
    collected = []
    for s in started:
        out = None
        if s is not None and not (failure is not None and (not isinstance(failure, Exception) or id(s[0]) in failed)):
            try:
                out = s[0].collect(s[1])
            except BaseException as e:
                failed.add(id(s[0]))
                failure = failure or e
        collected.append(out)
    if failure is not None:
        raise failure
    return result, collected
