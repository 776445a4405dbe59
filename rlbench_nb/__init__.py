"""rlbench-nb: notebook-first RL post-training of language models.

    import rlbench_nb as rl
    sess = rl.Session(rl.Config.load("configs/arith_grpo.yaml"))
    stats = sess.update(sess.prepare(sess.score(sess.rollout())))

The names below load on first use (PEP 562), so `import rlbench_nb` is instant and a helper process that
imports one light module (rlbench_nb.isolation) does not pay for torch, transformers and Ray.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Session": "session", "Config": "config", "ConfigError": "config", "Batch": "data.batch",
    "RLBenchError": "errors", "SessionStateError": "errors", "BackgroundRunError": "errors", "UsageError": "errors",
    "NonFiniteError": "errors", "CheckpointError": "checkpoint", "DatasetError": "data.datasets",
    "ClusterError": "cluster.errors", "WorkerError": "cluster.errors", "WorkerDiedError": "cluster.errors",
    "WeightSyncError": "cluster.errors",
    "load_rollouts": "rundir", "SnapshotError": "snapshots",
}
__all__ = sorted([*_EXPORTS, "inspect"])


_SUBPACKAGES = {"algos", "cluster", "data", "metrics", "ops", "roles", "widgets", "session", "runner", "config",
                "checkpoint", "errors", "export", "isolation", "prompts", "rundir", "guard", "snapshots", "branches"}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBPACKAGES:  # rl.roles.rollout_worker_class(...) without importing rlbench_nb.roles first
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'rlbench_nb' has no attribute '{name}'")
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def inspect(source, tokenizer=None):
    """Rollout inspector for a Batch or a saved rollouts file (rollouts/step_N.jsonl)."""
    from .widgets.inspector import inspect as _inspect
    return _inspect(source, tokenizer)


def load_ipython_extension(ip):
    """`%load_ext rlbench_nb`: readable worker errors and the `%rl` magic."""
    from .ipython import load_ipython_extension as load
    load(ip)


def unload_ipython_extension(ip):
    from .ipython import unload_ipython_extension as unload
    unload(ip)
