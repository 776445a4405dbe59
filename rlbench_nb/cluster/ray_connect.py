"""Connecting to Ray: an embedded cluster on loopback or one at `cluster.address`, finding a detached run's
actors by name, telling a lost cluster from a lost worker, and shutting down only the cluster we started.

    attach(cfg)                      # ray.init once per process; returns the cluster's resources
    find_run("run-name", "auto", ns)  # a detached run's meta (its run directory), for Session.attach
"""
from __future__ import annotations

import os
import time

from .errors import ClusterError

_STARTED_BY_US = False  # shutdown_if_ours stops only an embedded cluster this process started


def attach(cfg) -> dict:
    """Connect to Ray: an existing cluster at `cluster.address`, or an embedded one on loopback."""
    global _STARTED_BY_US
    import ray
    c = cfg.cluster
    if ray.is_initialized():
        return ray.cluster_resources()
    t0 = time.time()
    # no address: the cluster a `ray job submit` driver runs in (RAY_ADDRESS), else an embedded one: never a
    # `ray start` cluster that happens to run on this machine (ray.init() alone would join the newest one)
    address = c.address or os.environ.get("RAY_ADDRESS") or _warm_address()
    if address and address != "auto":
        _check_reachable(address)  # ray.init itself retries for many minutes on a dead address
    try:
        if address:
            ray.init(address=address, namespace=c.namespace, log_to_driver=c.log_to_driver)
        else:
            ray.init(address="local", num_cpus=c.num_cpus or os.cpu_count(), include_dashboard=c.dashboard,
                     namespace=c.namespace, log_to_driver=c.log_to_driver)
            _STARTED_BY_US = True
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address!r}" if address else "an embedded Ray"
        raise ClusterError(f"could not start or reach {where}: {str(e).splitlines()[0]} — check the address "
                           "(`ray status` on the head), that RAY_AUTH_MODE=token was set before ray was imported "
                           "when the cluster uses a token, or unset cluster.address for an embedded cluster") from None
    import logging
    logging.getLogger(__name__).info("ray attached in %.1fs: %s", time.time() - t0, ray.cluster_resources())
    return ray.cluster_resources()


def _warm_address() -> str | None:
    """The head `rlbench-nb up` started on this machine (warm.py), when it answers."""
    from .warm import running
    record = running()
    if record is not None:
        import logging
        logging.getLogger(__name__).info("joining the warm cluster at %s (rlbench-nb up)", record["address"])
    return record and record["address"]


def find_run(name: str, address: str | None, namespace: str) -> dict:
    """The meta a detached run's policy rank 0 keeps (its run directory), connecting to `address` first
    ("auto": the warm cluster of `rlbench-nb up` when there is one, else Ray's own choice)."""
    import ray

    from .warm import named_actor
    if not ray.is_initialized():
        if address == "auto":
            address = _warm_address() or address
        if address and address != "auto":
            _check_reachable(address)
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        except (ConnectionError, RuntimeError) as e:
            raise ClusterError(f"could not reach the Ray cluster at {address!r}: {str(e).splitlines()[0]}") from None
    try:
        policy0 = named_actor(f"{name}/policy/0", namespace)
    except ValueError:
        live = sorted({a["name"].split("/")[0] for a in ray.util.list_named_actors(True)
                       if a["namespace"] == namespace})
        raise ClusterError(f"no run named '{name}' in Ray namespace '{namespace}' (live runs: {live})") from None
    return ray.get(policy0.get_meta.remote())


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    import socket
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise ClusterError(f"could not start or reach the Ray cluster at cluster.address={address!r}: nothing "
                           f"answers there ({e}) — start it with `ray start --head`, check the address "
                           "(`ray status` on the head), or unset cluster.address for an embedded cluster") from None


def lost_cluster_error() -> ClusterError | None:
    """A ClusterError when the cluster's head (GCS) no longer answers, else None."""
    import ray
    try:
        address = ray.get_runtime_context().gcs_address
        _check_reachable(address, timeout_s=2.0)
    except ClusterError:
        return ClusterError(f"lost the Ray cluster at {address}: its head no longer answers, so every worker is "
                            "gone. Start the cluster again and continue from the latest checkpoint: "
                            "Session.load(run_dir) in Python, or `rlbench-nb train --resume RUN_DIR`")
    except Exception:  # anything else: the head may be fine; the caller reports the worker's own error
        return None


def shutdown_if_ours() -> None:
    global _STARTED_BY_US
    import ray
    if _STARTED_BY_US and ray.is_initialized():
        ray.shutdown()
        _STARTED_BY_US = False
