"""Start and re-attach: how long until a researcher can work.

    python benchmarks/startup.py                 # embedded cluster, then a Ray head with a killed controller
    python benchmarks/startup.py --reps 3 --json out.json

Each measure runs in a fresh Python process (imports included, as a new kernel or script pays them):
- `embedded`: `rl.Session(cfg)` with `cluster.backend=ray` and no address (Ray started by the session) until
  the first rollout is back: split into imports, `Session()` (Ray start, actors, models) and the rollout;
- `attach`: on a running Ray head, a controller with detached actors takes a step and is killed (SIGKILL);
  a new process runs `rl.Session.attach(name)` and one `step()`: split into imports, attach, the step.
The tiny config of the vs-TRL work (8 prompts x 8 samples, <= 8 new tokens), one thread per actor.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["data.batch_size=8", "rollout.n=8", "rollout.max_new_tokens=8", "run.save_rollouts_every=0",
        "run.tensorboard=false", "task.num_test=8", "cluster.backend=ray", "cluster.num_threads=1"]

CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
import transformers
import rlbench_nb as rl
transformers.logging.disable_progress_bar()
t1 = time.perf_counter()
mode, out = sys.argv[1], sys.argv[2]
if mode == "embedded":
    sess = rl.Session(rl.Config.load(None, sys.argv[3:]))
    t2 = time.perf_counter()
    sess.rollout()
    t3 = time.perf_counter()
    json.dump({"imports_s": t1 - t0, "session_s": t2 - t1, "work_s": t3 - t2}, open(out, "w"))
    sess.close()
elif mode == "first":  # detached actors, one step, then wait to be killed
    sess = rl.Session(rl.Config.load(None, sys.argv[3:]))
    sess.step()
    json.dump({"name": sess.name}, open(out, "w"))
    time.sleep(600)
else:  # attach
    sess = rl.Session.attach(sys.argv[3], address=sys.argv[4])
    t2 = time.perf_counter()
    sess.step()
    t3 = time.perf_counter()
    json.dump({"imports_s": t1 - t0, "session_s": t2 - t1, "work_s": t3 - t2}, open(out, "w"))
    sess.close()
'''


def child(args: list[str], out: Path, wait: bool = True):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args[:1], str(out), *args[1:]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if wait:
        assert proc.wait(timeout=600) == 0, f"{args[0]} failed"
        return json.loads(out.read_text())
    deadline = time.time() + 600
    while not out.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.3)
    return proc


def embedded(root: Path, rep: int) -> dict:
    return child(["embedded", *TINY, f"run.dir={root / f'embedded-{rep}'}"], root / f"embedded-{rep}.json")


def attach(root: Path, rep: int, address: str) -> dict:
    first_out = root / f"first-{rep}.json"
    first = child(["first", *TINY, f"run.dir={root / f'attach-{rep}'}", f"cluster.address={address}",
                   "cluster.detached=true"], first_out, wait=False)
    name = json.loads(first_out.read_text())["name"]
    first.send_signal(signal.SIGKILL)
    first.wait()
    return child(["attach", name, address], root / f"attach-{rep}.json")


def ray_head() -> tuple[subprocess.Popen, str]:
    """A Ray head of its own (`ray start --block` in a new process group: stopping it stops no other cluster
    on the machine, as `ray stop` would)."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run([ray, "get-auth-token", "--generate"], check=True, capture_output=True, env=env)
    head = subprocess.Popen([ray, "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
                             "--disable-usage-stats", "--block"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address, deadline = f"127.0.0.1:{port}", time.time() + 180
    while subprocess.run([ray, "status", f"--address={address}"], capture_output=True, env=env).returncode != 0:
        assert head.poll() is None and time.time() < deadline, "the Ray head did not start"
        time.sleep(0.5)
    return head, address


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="startup_"))
    # embedded first, with no other Ray cluster on the machine (a user's case): a second cluster beside it
    # slows an embedded start by ~6 s here (its ray.init waits twice as long for its raylet and API server)
    rows = [{"what": "embedded", **embedded(root, rep)} for rep in range(args.reps)]
    head, address = ray_head()
    try:
        rows += [{"what": "attach", **attach(root, rep, address)} for rep in range(args.reps)]
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head this started, and only it
        head.wait(timeout=60)
    print(f"\nstart-up, median of {args.reps} (fresh processes; tiny config, Ray, one thread per actor)")
    print(f"{'what':<10} {'imports s':>9} {'session s':>9} {'work s':>7} {'total s':>8}   "
          "session = Session() / attach by a new controller; work = first rollout / first step")
    for what in ("embedded", "attach"):
        rs = [r for r in rows if r["what"] == what]
        med = {k: statistics.median(r[k] for r in rs) for k in ("imports_s", "session_s", "work_s")}
        total = statistics.median(r["imports_s"] + r["session_s"] + r["work_s"] for r in rs)
        print(f"{what:<10} {med['imports_s']:>9.1f} {med['session_s']:>9.1f} {med['work_s']:>7.2f} {total:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
