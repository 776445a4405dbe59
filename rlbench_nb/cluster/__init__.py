"""Where role workers run. The backend is chosen here and only here, from `cfg.cluster.backend`:
`make_group` builds a role's ranks, `reattach_group` finds a detached run's live ones, `find_run` looks a
detached run up by name, `disconnect` stops an embedded cluster this process started."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ..fast_imports import defer_rfc3987_syntax
from .base import CallRecord, Pending, WorkerGroup
from .errors import ClusterError, WorkerDiedError, WorkerError
from .local import LocalWorkerGroup

TRAINER_ROLES = ("policy", "reference", "critic")

# Ray >= 2.59 protects clusters started on this machine (`ray start --head`) with the token in
# ~/.ray/auth_token, but a driver joining by address sends it only if RAY_AUTH_MODE=token is set before
# ray is imported: set it here, early, when that token exists. Not when ray is already imported: its
# settings are fixed by then, and a later mismatch breaks even an embedded cluster ("Failed to start GCS").
if os.path.exists(os.path.expanduser("~/.ray/auth_token")) and "ray" not in sys.modules:
    os.environ.setdefault("RAY_AUTH_MODE", "token")


defer_rfc3987_syntax()  # before anything here imports ray (fast_imports.py)


def in_process(cfg) -> bool:
    """The local backend: every worker is a plain object in this process (a reward function runs in its
    isolated processes there, reward.isolate; vLLM is imported here)."""
    return cfg.cluster.backend == "local"


def world_size_for(cfg, role: str) -> int:
    if in_process(cfg):
        return 1
    if role in TRAINER_ROLES or host_role(cfg, role):
        return cfg.cluster.train_ranks
    if role == "reward_model":
        return cfg.reward.model.ranks
    return cfg.cluster.rollout_ranks if role == "rollout" else 1


def check_placement(cfg, roles: list[str]) -> None:
    """Ray: attach, then refuse a layout the cluster cannot hold (pools.check_fits) before any actor starts."""
    if cfg.cluster.backend != "ray":
        return
    from .pools import check_fits, ray_nodes
    from .ray_connect import attach
    attach(cfg)
    check_fits(cfg, {r: 0 if host_role(cfg, r) else world_size_for(cfg, r) for r in roles}, ray_nodes())


def while_connecting(cfg, work: Callable[[], None]) -> None:
    """`work()`, and under Ray, when this process is not connected yet, the cluster's start (or joining it)
    at the same time: an embedded Ray spends seconds starting its processes, mostly waiting, which `work`
    (loading a task) fills. `ray.init` stays in this thread, as the processes it starts die with the thread
    that started them. `work`'s error comes first: it is the user's to fix, whatever the cluster did."""
    if cfg.cluster.backend != "ray" or ("ray" in sys.modules and sys.modules["ray"].is_initialized()):
        return work()
    from concurrent.futures import ThreadPoolExecutor

    from .ray_connect import attach
    pool = ThreadPoolExecutor(1, thread_name_prefix="session-load")
    loading = pool.submit(work)
    pool.shutdown(wait=False)  # its thread ends with `work`; Ctrl-C here does not wait for it
    try:
        attach(cfg)
    except Exception:
        loading.result()  # raises the work's own error, if it had one
        raise
    loading.result()


def make_group(cfg, role: str, worker_cls, *args, name: str = "run", host=None, wait: bool = True):
    """N ranks of `worker_cls(*args)`; under Ray the actors are named '<name>/<role>/<rank>', or the
    ranks live in `host`'s actors (another role's group). `wait=False`: under Ray, return once the actors
    are asked to start (`group.ready()` waits for them)."""
    if cfg.cluster.backend == "ray":
        from .ray_backend import RayWorkerGroup
        from .ray_connect import attach
        attach(cfg)
        return RayWorkerGroup(cfg, role, worker_cls, world_size_for(cfg, role), *args, name=name, host=host,
                              wait=wait)
    return LocalWorkerGroup(role, worker_cls, *args)


def reattach_group(cfg, role: str, name: str, host=None):
    """The live ranks of `role` in a detached run named `name` (Ray only: local workers die with their process)."""
    if cfg.cluster.backend != "ray":
        raise ClusterError(f"run '{name}' uses cluster.backend={cfg.cluster.backend}: only Ray actors outlive "
                           "their controller (cluster.backend=ray, cluster.detached=true)")
    from .ray_backend import RayWorkerGroup
    return RayWorkerGroup.reattach(cfg, role, world_size_for(cfg, role), name, host)


def find_run(name: str, address: str | None, namespace: str) -> dict:
    """What a detached run's policy actor recorded about itself (its run directory): connects to the Ray
    cluster at `address` first."""
    from .ray_connect import find_run as find
    return find(name, address, namespace)


def disconnect(cfg) -> None:
    """Stop the embedded Ray this process started for `cfg` (nothing for the local backend or a cluster
    someone else started)."""
    if cfg.cluster.backend == "ray":
        from .ray_connect import shutdown_if_ours
        shutdown_if_ours()


def host_role(cfg, role: str) -> str | None:
    """The role whose processes `role` lives in: under Ray, a colocated rollout lives in the policy's."""
    return "policy" if role == "rollout" and cfg.rollout.colocate and cfg.cluster.backend == "ray" else None
