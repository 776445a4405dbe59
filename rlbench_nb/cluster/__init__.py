"""Where role workers run. `make_group(cfg, role, cls, ...)` picks the backend from `cfg.cluster.backend`."""
from __future__ import annotations

from .local import CallRecord, LocalWorkerGroup, WorkerError


def make_group(cfg, role: str, worker_cls, *args, **kwargs):
    if cfg.cluster.backend == "local":
        return LocalWorkerGroup(role, worker_cls, *args, **kwargs)
    raise ValueError(f"cluster.backend='{cfg.cluster.backend}' is not available; use 'local'")
