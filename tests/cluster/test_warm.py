"""The warm cluster (`rlbench-nb up`, cluster/warm.py + keeper.py): kernels that come and go take warm processes,
a detached run is found again after its kernel is killed, a killed kernel's processes are reaped, and the cluster
stops by itself once no kernel is connected."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlbench_nb.metrics import read_jsonl

from ..conftest import REPO, SMALL, alive, wait_until

pytest.importorskip("ray")
pytestmark = pytest.mark.integration  # the second stage: see pyproject.toml's markers

CLI = os.path.join(os.path.dirname(sys.executable), "rlbench-nb")
# deterministic: the rows of a run on warm processes are compared with the same run in this process
CONFIG = [*SMALL, "run.deterministic=true", "run.tensorboard=false", "run.save_rollouts_every=0"]

KERNEL = """
import json, os, signal, sys, time, transformers
transformers.logging.disable_progress_bar()
import rlbench_nb as rl

mode, out = sys.argv[1], sys.argv[2]
sess = rl.Session(rl.Config.load(None, sys.argv[3:]))  # cluster.backend=ray, no address
pids = {role: g.info[0]["pid"] for role, g in sess.groups.items()}
steps = 2 if mode == "detached" else 0
for _ in range(steps):
    sess.step()
json.dump({"name": sess.name, "run_dir": str(sess.run_dir), "pids": pids}, open(out, "w"))
os.kill(os.getpid(), signal.SIGKILL)  # the kernel dies without closing its session
"""


def _kernel(tmp_path, mode: str, *args: str) -> dict:
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run([sys.executable, "-c", KERNEL, mode, str(out), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert out.exists(), (mode, proc.returncode, proc.stderr[-3000:])
    return json.loads(out.read_text())


# a cell of a Jupyter kernel of the rlbench-nb kernelspec (forked from the warm kernel server: its parent): a new kernel
# picks the detached run up, no address given, the warm cluster is found
ATTACH = """
import json, os, sys
forked = {{"parent": os.getppid(), "cwd": os.getcwd(), "path": sys.path}}
import rlbench_nb as rl
sess = rl.Session.attach("{name}")
before = sess.step_count
sess.step()
print(json.dumps({{**forked, "before": before, "after": sess.step_count,
                  "pids": [g.info[0]["pid"] for g in sess.groups.values()]}}))
sess.close()
"""


def _jupyter_kernel(tmp_path, code: str, server: int) -> dict:
    """`code` in a kernel Jupyter starts from the rlbench-nb kernelspec (kernel_launcher.py; its interrupt and kill
    are tests/test_kernel_server.py's): the JSON line it prints last."""
    from jupyter_client.manager import start_new_kernel

    from rlbench_nb.kernelspec import install
    install(prefix=str(tmp_path / "jupyter"))
    os.environ["JUPYTER_PATH"] = str(tmp_path / "jupyter" / "share" / "jupyter")
    km, kc = start_new_kernel(kernel_name="rlbench-nb", cwd=str(tmp_path))
    try:
        out = []
        reply = kc.execute_interactive(code, timeout=240,
                                       output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        result = json.loads("".join(out).strip().splitlines()[-1])
        assert result["parent"] == server and result["cwd"] == str(tmp_path), result
        # sys.path as a plain kernel's: '' (the kernel's folder), not the server's (`python -m` put it there)
        assert "" in result["path"] and os.environ["RLBENCH_NB_HOME"] not in result["path"], result["path"]
        return result
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        os.environ.pop("JUPYTER_PATH")


# Cost ~2.5 min: `up` (a Ray head, three processes importing torch + transformers), three kernels (six warm processes
# in all), the idle stop.
def test_kernels_take_warm_processes_and_the_cluster_stops_when_idle(tmp_path):
    home = Path(tempfile.mkdtemp(prefix="rw", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {**os.environ, "RLBENCH_NB_HOME": str(home)}
    before = os.environ.get("RLBENCH_NB_HOME")
    os.environ["RLBENCH_NB_HOME"] = str(home)  # the kernels below inherit it
    try:
        up = subprocess.run([CLI, "up", "--warm", "3", "--idle-timeout", "0.25", "--refill-after", "0"],
                            capture_output=True, text=True, timeout=300, env=env)
        assert up.returncode == 0, up.stderr[-3000:]
        assert "spare processes: 3 of 3 (pids " in up.stdout and "GB resident each" in up.stdout, up.stdout
        assert "warm kernels: the rlbench-nb kernelspec's kernels fork from pid" in up.stdout, up.stdout
        info = json.loads((home / "cluster.json").read_text())
        warm_pids = {int(p) for p in up.stdout.split("(pids ")[1].split(")")[0].split(", ")}
        assert len(warm_pids) == 3 and all(alive(p) for p in warm_pids), up.stdout

        args = [*CONFIG, f"run.dir={tmp_path / 'runs'}", "cluster.backend=ray"]
        first = _kernel(tmp_path, "detached", *args, "cluster.detached=true")
        assert set(first["pids"].values()) == warm_pids  # policy, rollout and reward took the warm processes

        again = subprocess.run([CLI, "up"], capture_output=True, text=True, timeout=120, env=env)
        assert f"runs on it: {first['name']}" in again.stdout, again.stdout  # already up: what it holds

        server = json.loads((home / "kernels.json").read_text())["pid"]
        attached = _jupyter_kernel(tmp_path, ATTACH.format(name=first["name"]), server)
        assert attached["before"] == 2 and attached["after"] == 3
        assert set(attached["pids"]) == warm_pids  # found through the keeper: the same processes, same weights
        assert wait_until(lambda: not any(alive(p) for p in warm_pids), 30)  # closed: its processes are gone

        killed = _kernel(tmp_path, "killed", *args)  # refilled spares; its kernel dies without closing
        taken = set(killed["pids"].values())
        assert len(taken) == 3 and not taken & warm_pids
        assert wait_until(lambda: not any(alive(p) for p in taken), 30), "a dead kernel's processes were not reaped"

        # no kernel connected for 15 s: the keeper stops the whole cluster and removes its record
        assert wait_until(lambda: not (home / "cluster.json").exists(), 120)
        assert wait_until(lambda: not _cluster_processes(info["temp_dir"]), 60), _cluster_processes(info["temp_dir"])
        assert wait_until(lambda: not alive(server), 30), "the warm kernel server outlived its cluster"
        down = subprocess.run([CLI, "down"], capture_output=True, text=True, timeout=60, env=env)
        assert "no warm cluster is up" in down.stdout
        rows = [r for r in read_jsonl(Path(first["run_dir"]) / "metrics.jsonl") if "reward/mean" in r]
        assert _same_as_here(rows, tmp_path)  # in this process, once the cluster's processes are gone
    finally:
        os.environ["RLBENCH_NB_HOME"] = before or ""
        subprocess.run([CLI, "down"], capture_output=True, timeout=120, env=env)
        for line in _cluster_processes(str(home / "ray")):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)


def _cluster_processes(temp_dir: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", temp_dir], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def _same_as_here(rows: list[dict], tmp_path) -> bool:
    """The warm run's three steps against the same config stepped in this process (the local backend)."""
    import rlbench_nb as rl
    drop = ("time/", "throughput/", "memory/", "sync/")
    with rl.Session(rl.Config.load(None, [*CONFIG, f"run.dir={tmp_path / 'here'}"])) as sess:
        sess.run(steps=3, progress=False)
        here = [r for r in read_jsonl(sess.run_dir / "metrics.jsonl") if "reward/mean" in r]
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith(drop)}  # noqa: E731
    return len(rows) == 3 and [keep(r) for r in rows] == [keep(r) for r in here]
