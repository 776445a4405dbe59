"""Attach to a real `ray start --head` cluster (a controller, the cluster notebook), survive a killed controller,
and leave nothing behind."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import REPO, SMALL
from ..ray_heads import RayHead
from ..test_notebooks import execute

pytest.importorskip("ray")
pytestmark = pytest.mark.integration  # the second stage: see pyproject.toml's markers


def ray_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "gcs_server|raylet|default_worker"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def processes_of(gcs_address: str) -> list[str]:
    """The GCS and raylet of the cluster at `gcs_address` (theirs name its port on their command lines), not those
    of other clusters on this machine (the shared `ray_head`, another test's)."""
    port = gcs_address.rsplit(":", 1)[1]
    return [line for line in ray_processes() if f":{port}" in line or f"_port={port}" in line]


# Cost ~12 s: the bound is the point (ray.init alone would retry for minutes).
def test_unreachable_address_is_a_clear_error_not_a_hang(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    script = "import rlbench_nb as rl, sys; rl.Session(rl.Config.load(None, sys.argv[1:]))"
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", script, *SMALL, f"run.dir={tmp_path}", "cluster.backend=ray",
                          f"cluster.address=127.0.0.1:{port}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert f"ClusterError: could not start or reach the Ray cluster at cluster.address='127.0.0.1:{port}'" in out.stderr
    assert time.time() - t0 < 120


LOSES_CLUSTER = """
import sys, time, transformers
transformers.logging.disable_progress_bar()
import rlbench_nb as rl
flag = sys.argv[1]
sess = rl.Session(rl.Config.load(None, sys.argv[2:]))
sess.step()
open(flag, "w").write("stepped")
while open(flag).read() != "stopped":   # the test stops the cluster under us
    time.sleep(0.1)
t = time.time()
try:
    sess.step()
except Exception as e:
    print(f"RAISED after {time.time() - t:.0f}s: {type(e).__name__}: {e}", flush=True)
    sys.exit(3)
print("NO ERROR", flush=True)
"""


# Cost ~75 s with its own head (stopped under the session, so it cannot share the module's): the only lost-cluster
# check.
def test_a_lost_cluster_is_a_clear_error_not_a_hang(tmp_path):
    with RayHead() as head:  # its own head: the test stops it under the session
        _lose_the_cluster(head, tmp_path)


def _lose_the_cluster(head: RayHead, tmp_path) -> None:
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", LOSES_CLUSTER, str(flag), *SMALL, f"run.dir={tmp_path}",
                             "cluster.backend=ray", f"cluster.address={head.address}", "cluster.call_timeout_s=30",
                             "run.tensorboard=false"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 300
    while not (flag.exists() and flag.read_text() == "stepped"):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:] if proc.poll() else "slow"
        time.sleep(0.2)
    assert not head.stop(), "the head's processes outlived its stop"
    flag.write_text("stopped")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, (out[-2000:], err[-3000:])
    raised = next(line for line in out.splitlines() if line.startswith("RAISED"))
    assert "ClusterError: lost the Ray cluster at " in raised and "its head no longer answers" in raised
    assert "rlbench-nb train --resume RUN_DIR" in raised
    assert int(raised.split()[2].rstrip("s:")) < 60  # seconds: an error, not a hang


EMBEDDED = """
import sys, time, transformers
from pathlib import Path
import ray
import rlbench_nb as rl
addr, go = Path(sys.argv[1]), Path(sys.argv[2])
sess = rl.Session(rl.Config.load(None, sys.argv[3:]))
addr.write_text(ray.get_runtime_context().gcs_address)
deadline = time.time() + 120
while not go.exists() and time.time() < deadline:  # the test tries to connect without the token meanwhile
    time.sleep(0.2)
sess.step()
print(sess)
sess.close()
"""


# Cost ~40 s: an embedded cluster, a second process trying it without the token, then a step; the only security check
# of Ray's ports.
def test_the_embedded_cluster_refuses_a_client_without_its_token(tmp_path):
    """Ray binds every interface (it ignores loopback-only requests); the embedded cluster is safe only
    because it is token-authenticated. A client without the token is refused. The session then steps and
    closes, and closing stops the embedded cluster it started: none of its Ray processes is left (those of the
    shared head, started by conftest.ray_head, are not its)."""
    addr, go = tmp_path / "gcs", tmp_path / "go"
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        owner = subprocess.Popen([sys.executable, "-c", EMBEDDED, str(addr), str(go), *SMALL, f"run.dir={tmp_path}",
                                  "cluster.backend=ray", "run.tensorboard=false"], cwd=REPO, stdout=out, stderr=err)
    try:
        deadline = time.time() + 180
        while not addr.exists() or not addr.read_text():
            assert owner.poll() is None and time.time() < deadline
            time.sleep(0.2)
        intruder = subprocess.Popen(
            [sys.executable, "-c", f"import ray; ray.init(address={addr.read_text()!r}); print('CONNECTED')"],
            env={**os.environ, "RAY_AUTH_MODE": "disabled", "HOME": str(tmp_path)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        seen = []
        deadline = time.time() + 60
        for line in intruder.stdout:
            seen.append(line)
            if "InvalidAuthToken" in line or "CONNECTED" in line or time.time() > deadline:
                break
        intruder.kill()
        assert any("Unauthenticated" in entry and "InvalidAuthToken" in entry for entry in seen), "".join(seen)[-2000:]
        assert not any(entry.startswith("CONNECTED") for entry in seen)
        go.touch()
        assert owner.wait(timeout=300) == 0, (tmp_path / "err").read_text()[-2000:]
        assert "policy       rank 0  pool=default node=" in (tmp_path / "out").read_text()
        deadline = time.time() + 30
        while processes_of(addr.read_text()) and time.time() < deadline:
            time.sleep(0.5)
        assert not processes_of(addr.read_text()), "close() must stop the embedded cluster it started"
    finally:  # after a failure above: stop the owner and what it started (that cluster alone)
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for line in processes_of(addr.read_text()) if addr.exists() and addr.read_text() else []:
            os.kill(int(line.split()[0]), signal.SIGKILL)


# The tests below share one head (a head costs ~25 s to start); they come last in this file, so that the head lives
# only while they run (pytest runs a module's tests in file order and ends a module fixture after its last test).
@pytest.fixture(scope="module")
def ray_head():
    """A `ray start --head` cluster (token auth) that the tests below attach to and leave as they found it: each
    run they start, they close. Stopped alone at the end (tests/ray_heads.py), whatever else runs here."""
    head = RayHead()
    yield head.address
    assert not head.stop(), "the head's processes outlived its stop"


CONTROLLER = """
import hashlib, json, sys, time, transformers
transformers.logging.disable_progress_bar()
import rlbench_nb as rl

def digest(sess):
    w = sess.groups["policy"].call("get_weights")[0]
    return hashlib.sha256(b"".join(w[k].numpy().tobytes() for k in sorted(w))).hexdigest()

mode, out = sys.argv[1], sys.argv[2]
if mode == "first":
    sess = rl.Session(rl.Config.load(None, sys.argv[3:]))
    for _ in range(3):
        sess.step()
    json.dump({"name": sess.name, "digest": digest(sess), "run_dir": str(sess.run_dir)}, open(out, "w"))
    time.sleep(600)  # killed by the test
elif mode == "second":  # attaches, steps, then holds the run until told to step again
    sess = rl.Session.attach(sys.argv[3], address=sys.argv[4])
    before = {"step": sess.step_count, "digest": digest(sess), "history": len(sess.history)}
    row = sess.step()
    json.dump({**before, "after_step": sess.step_count, "reward": row["reward/mean"]}, open(out, "w"))
    go = out + ".go"
    while not __import__("os").path.exists(go):
        time.sleep(0.2)
    try:
        sess.step()
        fenced = "stepped"
    except rl.SessionStateError as e:
        fenced = str(e)
    json.dump({"fenced": fenced}, open(out + ".fenced", "w"))
else:  # "third": a second controller on the same run, refused; then taking it over
    try:
        rl.Session.attach(sys.argv[3], address=sys.argv[4])
        refused = "attached"
    except rl.RLBenchError as e:
        refused = f"{type(e).__name__}: {e}"
    sess = rl.Session.attach(sys.argv[3], address=sys.argv[4], take_over=True)
    row = sess.step()
    json.dump({"refused": refused, "step": sess.step_count}, open(out, "w"))
    sess.close()
"""


# Cost ~65 s: a controller subprocess starts detached actors, is SIGKILLed, and a second one attaches; nothing else
# kills a controller under Ray.
def test_killed_controller_reattaches_to_detached_actors(ray_head, tmp_path):
    first_out, second_out = tmp_path / "first.json", tmp_path / "second.json"
    args = [*SMALL, f"run.dir={tmp_path / 'runs'}", "run.tensorboard=false", "cluster.backend=ray",
            f"cluster.address={ray_head}", "cluster.detached=true", "cluster.train_ranks=2", "cluster.num_threads=1"]
    first = subprocess.Popen([sys.executable, "-c", CONTROLLER, "first", str(first_out), *args], cwd=REPO)
    deadline = time.time() + 300
    while not first_out.exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.5)
    time.sleep(0.5)
    assert first_out.exists(), "the first controller did not finish its 3 steps"
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = json.loads(first_out.read_text())
    second = subprocess.Popen([sys.executable, "-c", CONTROLLER, "second", str(second_out), before["name"],
                               ray_head], cwd=REPO)
    while not second_out.exists() and time.time() < deadline and second.poll() is None:
        time.sleep(0.5)
    time.sleep(0.5)
    after = json.loads(second_out.read_text())
    assert after["step"] == 3 and after["history"] == 3 and after["after_step"] == 4
    assert after["digest"] == before["digest"]  # the same weights, held by the same actors
    # a second live controller on the run is refused, naming the holder; take_over=True fences the holder
    third_out = tmp_path / "third.json"
    subprocess.run([sys.executable, "-c", CONTROLLER, "third", str(third_out), before["name"], ray_head],
                   cwd=REPO, check=True, timeout=300)
    third = json.loads(third_out.read_text())
    assert third["refused"].startswith(f"RunInUseError: run directory {before['run_dir']} is in use by process "
                                       f"{second.pid}"), third["refused"]
    assert third["step"] == 5
    Path(str(second_out) + ".go").write_text("step again")
    assert second.wait(timeout=120) == 0
    fenced = json.loads(Path(str(second_out) + ".fenced").read_text())["fenced"]
    assert fenced.startswith("cannot rollout: run directory") and "was taken over by" in fenced, fenced
    rows = [json.loads(line) for line in open(os.path.join(before["run_dir"], "metrics.jsonl"))]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4, 5]  # the fenced step wrote nothing

    # attaching to a run the cluster does not hold is one clear line (on the same head: a head costs ~35 s)
    out = subprocess.run([sys.executable, "-c",
                          f"import rlbench_nb as rl; rl.Session.attach('nope', address={ray_head!r})"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ClusterError: no run named 'nope' in Ray namespace 'rlbench-nb'" in out.stderr


# Cost ~50 s on the module's shared head (its start paid once for two tests): notebook 03, the cluster journey, in a
# kernel.
def test_the_cluster_notebook_attaches_and_overlaps(ray_head, tmp_path):
    """notebooks/03_cluster.ipynb on the head above, in a real kernel: two FSDP ranks in their pool, the reward in
    its own, the rollout overlapped with training."""
    text = execute("03_cluster.ipynb", f"address = {ray_head!r}\nsteps = 3\nrun_dir = {str(tmp_path)!r}\n"
                                       f"overrides = {[*SMALL, 'run.tensorboard=false']!r}")
    assert re.search(r"policy       rank 1  pool=trainers node=[\d.]+/\w{6} ", text)  # two FSDP ranks, in their pool
    assert re.search(r"reward       rank 0  pool=light node=[\d.]+/\w{6} pid=\d+ device=cpu", text)
    m = re.search(r"(\d+) steps on (\d+) policy ranks; rollout overlapped (\d+)%", text)
    assert m and m.group(1) == "3" and m.group(2) == "2" and int(m.group(3)) > 0
