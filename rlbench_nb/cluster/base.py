"""What the controller may ask of a role's workers, whichever backend runs them.

A `WorkerGroup` is N ranks of one worker class. Dispatch comes in three shapes: the same arguments to
every rank (`call`), a batch split by data-parallel rank (`call_shards` / `call_split`), and per-rank
arguments (`call_each`). Each has a `submit_*` twin that starts the calls and returns a `Pending`;
`collect(pending)` waits for them, so two roles can work at once. Every call leaves a `CallRecord` (the
phase timeline) and the rank's memory snapshot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..data.batch import Batch


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
    def call(self, method: str, *args, **kwargs) -> list: ...
    def submit(self, method: str, *args, **kwargs) -> Pending: ...
    def call_each(self, method: str, per_rank_args: list[tuple]) -> list: ...
    def call_rank0(self, method: str, *args, **kwargs) -> Any: ...
    def call_shards(self, method: str, batch: Batch, *args, **kwargs) -> list: ...
    def submit_shards(self, method: str, batch: Batch, *args, **kwargs) -> Pending: ...
    def call_split(self, method: str, batch: Batch, *args, **kwargs) -> Batch: ...
    def submit_stored(self, method: str, *args, to: WorkerGroup | None = None, **kwargs) -> Pending: ...
    def collect(self, pending: Pending) -> list: ...
    def dead_ranks(self) -> list[int]: ...
    def close(self) -> None: ...
