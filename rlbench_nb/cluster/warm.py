"""A warm cluster: a Ray head and role processes that outlive kernels, so a new kernel's `Session()` skips the
start-up floor (starting Ray, and each role's process importing torch and transformers).

    rlbench-nb up                   # a Ray head on this machine + 4 warm processes; stops after 30 idle minutes
    rl.Session(cfg)                 # cluster.backend=ray, no address: joins it and takes warm processes
    rlbench-nb down                 # stops it (every run's actors on it with it; run directories stay)

`up` also starts the warm kernel server (kernel_server.py): kernels of the rlbench-nb kernelspec are forked from a
process that has imported torch, transformers, Ray and the session already; it stops with the cluster.

`up` writes where the head is to $RLBENCH_NB_HOME/cluster.json (default ~/.rlbench-nb); `Session()` with
`cluster.backend=ray` and no `cluster.address` (nor $RAY_ADDRESS) joins the head named there, when it answers,
instead of starting an embedded one. The keeper (keeper.py) hands each rank that fits a warm process (a role on
the default pool with a CPU share only: no GPU, labels or custom resources) and starts a replacement
`refill_after_s` later; a rank that does not fit, or finds none spare, starts cold as before.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..kernel_launcher import home
from ..kernel_server import server_pid
from .errors import ClusterError
from .keeper import KEEPER_NAME, WARM_NAMESPACE, Keeper

READY = "block forever"  # what `ray start --block` prints once every process of the head is up


def _info_path() -> Path:
    return home() / "cluster.json"


def running() -> dict | None:
    """The warm cluster's record (address, head pid, temp dir) when its head answers; a stale record is removed."""
    try:
        record = json.loads(_info_path().read_text())
    except (OSError, ValueError):
        return None
    host, _, port = record["address"].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return record
    except OSError:
        _info_path().unlink(missing_ok=True)
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up(cpus: int = 0, spare: int = 4, idle_timeout_s: float = 1800.0, refill_after_s: float = 30.0,
       kernels: bool = True) -> dict:
    """Start the head (a `ray start --head --block` of its own, in its own session: it outlives this process),
    the keeper and (`kernels`) the warm kernel server; return the keeper's status once the warm processes are
    ready, with the kernel server's pid. Already up: its status (and a kernel server started if none runs)."""
    if running() is None:
        _start_head(cpus)
    record = running()
    if record is None:
        raise ClusterError(f"rlbench-nb up: the Ray head stopped right after it started; see {home() / 'head.log'}")
    kernel_server = _start_kernel_server() if kernels else None
    if "ray" not in sys.modules:  # a driver joining a token-protected head must say so before ray is imported
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray
    ray.init(address=record["address"], namespace=WARM_NAMESPACE, log_to_driver=False)
    try:
        try:
            keeper = ray.get_actor(KEEPER_NAME, namespace=WARM_NAMESPACE)
        except ValueError:
            keeper = ray.remote(Keeper).options(name=KEEPER_NAME, namespace=WARM_NAMESPACE, lifetime="detached",
                                                num_cpus=0, max_concurrency=4).remote(
                spare, idle_timeout_s, refill_after_s, record["head_pid"], str(_info_path()))
        status = ray.get(keeper.status.remote(wait=True))
    finally:
        ray.shutdown()
    return {**record, **status, "kernel_server": _kernel_server_ready(kernel_server) if kernels else None}


def _start_kernel_server():
    """The warm kernel server's process, started unless one runs (then its pid): its imports overlap the keeper's."""
    pid = server_pid(home())
    if pid is not None:
        return pid
    # without the RAY_AUTH_MODE=token that rlbench_nb.cluster's import set here: the server's own import sets it
    # again, as a kernel's would, so kernels from a Jupyter without it are not refused for it (kernel_server.py)
    env = {k: v for k, v in os.environ.items() if (k, v) != ("RAY_AUTH_MODE", "token")}
    with (home() / "kernels.log").open("w") as log:  # in its own session, from a folder of no project
        return subprocess.Popen([sys.executable, "-m", "rlbench_nb.kernel_server"], cwd=home(), stdout=log, env=env,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _kernel_server_ready(started, timeout_s: float = 300.0) -> int:
    """The kernel server's pid once it listens; its log's end when it stopped first."""
    if isinstance(started, int):
        return started
    deadline = time.time() + timeout_s
    while (pid := server_pid(home())) != started.pid:
        if pid is not None and started.poll() is not None:
            return pid  # another `up` started one first: ours found its lock taken and left
        if started.poll() is not None or time.time() > deadline:
            started.kill()
            raise ClusterError("rlbench-nb up: the warm kernel server did not start; its log "
                               f"({home() / 'kernels.log'}) ends:\n" + (home() / "kernels.log").read_text()[-2000:])
        time.sleep(0.2)
    return started.pid


def _start_head(cpus: int) -> None:
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    home().mkdir(parents=True, exist_ok=True)
    temp_dir = home() / "ray"  # short: Ray's unix socket paths must stay under ~107 characters
    log = home() / "head.log"
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # Ray >= 2.59: a `ray start` head wants its token
    subprocess.run([ray_cli, "get-auth-token", "--generate"], check=True, timeout=60, capture_output=True, env=env)
    port = _free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", f"--port={port}", f"--num-cpus={cpus or os.cpu_count()}",
             f"--temp-dir={temp_dir}", f"--ray-client-server-port={_free_port()}",
             f"--dashboard-agent-listen-port={_free_port()}", "--include-dashboard=false", "--disable-usage-stats"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + 180
    while READY not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            _stop_head(proc.pid, temp_dir)
            raise ClusterError(f"rlbench-nb up: the Ray head did not start; its log ({log}) ends:\n"
                               + log.read_text()[-2000:])
        time.sleep(0.2)
    _info_path().write_text(json.dumps({"address": f"127.0.0.1:{port}", "head_pid": proc.pid,
                                        "temp_dir": str(temp_dir), "started": time.time()}))


def down(timeout_s: float = 60.0) -> dict | None:
    """Stop the warm cluster (its head, its warm processes, every actor on it); None when none was up."""
    record = running()
    if record is None:
        return None
    _info_path().unlink(missing_ok=True)
    _stop_kernel_server()
    _stop_head(record["head_pid"], Path(record["temp_dir"]), timeout_s)
    return record


def _stop_kernel_server() -> None:
    """SIGTERM to the kernel server (it also stops by itself within seconds once the cluster's record is gone);
    kernels it forked keep running: they are the user's, and Jupyter stops them."""
    pid = server_pid(home())
    if pid is not None:
        os.kill(pid, signal.SIGTERM)


def _stop_head(pid: int, temp_dir: Path, timeout_s: float = 60.0) -> None:
    """SIGTERM to the blocking `ray start`, which stops what it started; SIGKILL to what is left after
    `timeout_s` (every process of the cluster names its temp dir on its command line)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + timeout_s
    while time.time() < deadline and _processes(temp_dir):
        time.sleep(0.2)
    for line in _processes(temp_dir):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _processes(temp_dir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(temp_dir)], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


# ---- what a session on the warm cluster asks of the keeper --------------------------------------
def _keeper():
    """The keeper, when this process is connected to a warm cluster; else None."""
    import ray
    try:
        return ray.get_actor(KEEPER_NAME, namespace=WARM_NAMESPACE)
    except ValueError:
        return None


def fits(placement) -> bool:
    """Whether a role's ranks can run in warm processes: the default pool, a CPU share and nothing else."""
    return placement.pool == "default" and set(placement.bundle) == {"CPU"} and not placement.labels \
        and placement.device in ("auto", "cpu")


def take(names: list[str], detached: bool) -> list | None:
    """Warm processes for these full actor names ("namespace/name"), or None (no keeper, or too few spare)."""
    import ray
    keeper = _keeper()
    if keeper is None:
        return None
    return ray.get(keeper.take.remote(names, ray.get_runtime_context().get_job_id(), detached))


def release(names: list[str]) -> None:
    keeper = _keeper()
    if keeper is not None:
        keeper.release.remote(names)


def named_actor(name: str, namespace: str):
    """The live actor called `name`: one started under that name, or a warm process a run took for it."""
    import ray
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        keeper = _keeper()
        actor = ray.get(keeper.lookup.remote(f"{namespace}/{name}")) if keeper is not None else None
        if actor is None:
            raise
        return actor
