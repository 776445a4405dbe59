"""Start and re-attach: how long until a researcher can work.

    python benchmarks/startup.py                 # embedded cluster, then a Ray head with a killed controller
    python benchmarks/startup.py --reps 3 --json out.json

Each measure runs in a fresh Python process (imports included, as a new kernel or script pays them):
- `embedded`: `rl.Session(cfg)` with `cluster.backend=ray` and no address (Ray started by the session) until
  the first rollout is back: split into imports, `Session()` (Ray start, actors, models) and the rollout;
- `attach`: on a running Ray head, a controller with detached actors takes a step and is killed (SIGKILL);
  a new process runs `rl.Session.attach(name)` and one `step()`: split into imports, attach, the step;
- `warm`: on the warm cluster of `rlbench-nb up` (cluster/warm.py), a new process's `rl.Session(cfg)` with no
  address (it joins that cluster and takes warm processes) until the first rollout is back: a new kernel's start;
- `warm kernel`: the same cell in a Jupyter kernel of the rlbench-nb kernelspec, which `up`'s warm kernel server
  forks with torch, transformers, Ray and the session imported (kernel_server.py), timed from asking for the kernel.
The tiny config of the vs-TRL work (8 prompts x 8 samples, <= 8 new tokens), one thread per actor.

Beside each, its **floor**, measured the same way in the same run: what any program must pay to reach the same
point with the same processes and nothing of ours in between —
- embedded: the imports, an embedded `ray.init`, and one bare actor per role of the session (policy, rollout,
  reward) that imports torch and transformers, builds the same model and runs one forward, all side by side;
- attach: the imports, `ray.init(address=...)` to the running head, and one call on an actor already there;
- warm: that attach floor on the warm cluster, and a controller floor: the same plus what any controller that holds
  tensors and tokenises prompts imports and loads (torch, and the task's tokenizer by its class);
- warm kernel: a plain ipykernel started the same way, running the attach floor's imports, connect and call.
Every child, the floors' too, first puts off rfc3987_syntax's import as rlbench_nb.cluster does (fast_imports.py:
~2.5 s of `import ray` here otherwise), so a floor is not slower by what ours saves with a trick anyone could use.
The ratio (ours / floor) is what carries from one machine to another; absolute seconds do not.
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
from rlbench_nb.fast_imports import defer_rfc3987_syntax
defer_rfc3987_syntax()  # what rlbench_nb.cluster does before ray is imported: the floors get it too
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
elif mode == "floor-embedded":  # the embedded start with nothing of ours: Ray, and bare role processes
    import os
    import ray
    cfg = rl.Config.load(None, sys.argv[3:])
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    t2 = time.perf_counter()

    @ray.remote
    class Bare:
        def __init__(self, model_cfg):
            import torch
            import transformers  # noqa: F401  (what a role process imports)
            from rlbench_nb.data.tasks.arithmetic import make_model
            self.model, self.torch = make_model(model_cfg, 64, seed=0), torch

        def forward(self):
            with self.torch.no_grad():
                return float(self.model(input_ids=self.torch.zeros(1, 8, dtype=self.torch.long)).logits.sum())
    # Side by side, each reserving what the session's workers reserve (cluster.cpus_per_worker): with a whole
    # CPU each, the third of three would wait forever on two cores.
    bare = Bare.options(num_cpus=cfg.cluster.cpus_per_worker)
    roles = [bare.remote(cfg.model) for _ in ("policy", "rollout", "reward")]
    ray.get([r.forward.remote() for r in roles])
    t3 = time.perf_counter()
    json.dump({"imports_s": t1 - t0, "session_s": t2 - t1, "work_s": t3 - t2}, open(out, "w"))
    ray.shutdown()
elif mode in ("floor-attach", "floor-controller"):  # connect to the head, one call on an actor already there
    import os
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # the head wants its token, as rlbench_nb.cluster sets
    if mode == "floor-controller":  # and what a controller needs besides: torch, the task's tokenizer (its class
        import torch  # noqa: F401   # named, as a controller that knows it loads it: not through AutoTokenizer)
        getattr(transformers, sys.argv[6]).from_pretrained(sys.argv[5])
        t1 = time.perf_counter()
    import ray
    ray.init(address=sys.argv[4], namespace="startup-floor", log_to_driver=False)
    t2 = time.perf_counter()
    ray.get(ray.get_actor(sys.argv[3]).ping.remote())
    t3 = time.perf_counter()
    json.dump({"imports_s": t1 - t0, "session_s": t2 - t1, "work_s": t3 - t2}, open(out, "w"))
elif mode == "resident":  # the actor the attach floor calls: detached, so it outlives this process
    import os
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # the head wants its token, as rlbench_nb.cluster sets
    import ray
    ray.init(address=sys.argv[4], namespace="startup-floor", log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Resident:
        def ping(self):
            return 1
    r = Resident.options(name=sys.argv[3], lifetime="detached").remote()
    ray.get(r.ping.remote())
    json.dump({}, open(out, "w"))
else:  # attach
    sess = rl.Session.attach(sys.argv[3], address=sys.argv[4])
    t2 = time.perf_counter()
    sess.step()
    t3 = time.perf_counter()
    json.dump({"imports_s": t1 - t0, "session_s": t2 - t1, "work_s": t3 - t2}, open(out, "w"))
    sess.close()
'''


def child(args: list[str], out: Path, wait: bool = True):
    err = out.with_suffix(".err")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args[:1], str(out), *args[1:]],
                            stdout=subprocess.DEVNULL, stderr=err.open("w"))
    if wait:
        assert proc.wait(timeout=600) == 0, f"{args[0]} failed:\n{err.read_text()[-2000:]}"
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


def warm(root: Path, reps: int, tokenizer: tuple[str, str]) -> list[dict]:
    """`rlbench-nb up`, then per rep: a new process's `Session()` (no address) to its first rollout, and the
    floors beside it on the same cluster. Before each rep the keeper's spares are back and ready (`up` again)."""
    cli = os.path.join(os.path.dirname(sys.executable), "rlbench-nb")
    os.environ["RLBENCH_NB_HOME"] = str(root / "w")  # this cluster's record; the children inherit it
    rows = []
    try:
        subprocess.run([cli, "up", "--warm", "3", "--refill-after", "0", "--idle-timeout", "0"], check=True,
                       capture_output=True, timeout=600)
        address = json.loads((root / "w" / "cluster.json").read_text())["address"]
        child(["resident", "startup-resident", address], root / "warm-resident.json")
        for rep in range(reps):
            time.sleep(3)  # the keeper's tick: replacements for the last rep's processes are asked for
            up = subprocess.run([cli, "up"], check=True, capture_output=True, text=True, timeout=600)
            # the floors first, on a quiet cluster: after ours the keeper's replacements import torch beside them
            rows.append({"what": "warm: attach floor",
                         **child(["floor-attach", "startup-resident", address], root / f"floor-w-{rep}.json")})
            rows.append({"what": "warm: controller floor", **child(["floor-controller", "startup-resident", address,
                                                                    *tokenizer], root / f"floor-c-{rep}.json")})
            rows.append({"what": "warm", **child(["embedded", *TINY, f"run.dir={root / f'warm-{rep}'}"],
                                                 root / f"warm-{rep}.json"), "up": up.stdout})
            # Jupyter kernels: a plain ipykernel running the attach floor's cell, then one of the rlbench-nb
            # kernelspec (forked from the warm kernel server) running `Session(cfg)` to its first rollout
            rows.append({"what": "kernel: attach floor", **in_kernel("plain", KERNEL_FLOOR.format(address=address))})
            subprocess.run([cli, "up"], check=True, capture_output=True, timeout=600)  # spares back, ready
            rows.append({"what": "warm kernel", **in_kernel("rlbench-nb", KERNEL_SESSION.format(
                overrides=[*TINY, f"run.dir={root / f'kernel-{rep}'}"]))})
    finally:
        subprocess.run([cli, "down"], capture_output=True, timeout=120)
        os.environ.pop("RLBENCH_NB_HOME")
    return rows


KERNEL_FLOOR = """
import time
t0 = time.time()
from rlbench_nb.fast_imports import defer_rfc3987_syntax
defer_rfc3987_syntax()
import os, transformers, rlbench_nb
os.environ.setdefault("RAY_AUTH_MODE", "token")
import ray
t1 = time.time()
ray.init(address="{address}", namespace="startup-floor", log_to_driver=False)
t2 = time.time()
ray.get(ray.get_actor("startup-resident").ping.remote())
t3 = time.time()
print(t0, t1, t2, t3)
"""
KERNEL_SESSION = """
import time
t0 = time.time()
import transformers, rlbench_nb as rl
transformers.logging.disable_progress_bar()
t1 = time.time()
sess = rl.Session(rl.Config.load(None, {overrides!r}))
t2 = time.time()
sess.rollout()
t3 = time.time()
print(t0, t1, t2, t3)
"""


def in_kernel(spec: str, cell: str) -> dict:
    """A Jupyter kernel of `spec` started as Jupyter starts one, then `cell`: imports = from asking for the kernel
    to the cell's imports done (the kernel's own start included), session and work as the cell times them."""
    from jupyter_client.manager import start_new_kernel
    asked = time.time()
    km, kc = start_new_kernel(kernel_name=spec)
    try:
        out = []
        reply = kc.execute_interactive(cell, timeout=600,
                                       output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        t0, t1, t2, t3 = map(float, "".join(out).split()[-4:])
        kc.execute_interactive("sess.close()" if "sess" in cell else "ray.shutdown()", timeout=120)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return {"imports_s": t1 - asked, "session_s": t2 - t1, "work_s": t3 - t2, "kernel_start_s": t0 - asked}


def kernelspecs(root: Path) -> None:
    """The rlbench-nb kernelspec (kernel_launcher.py) and a plain ipykernel one, where this process's Jupyter
    client finds them."""
    from rlbench_nb.kernelspec import install, kernel_json
    install(prefix=str(root / "jupyter"))
    plain = root / "jupyter" / "share" / "jupyter" / "kernels" / "plain"
    plain.mkdir(parents=True)
    spec = kernel_json("plain", None)
    spec["argv"] = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (plain / "kernel.json").write_text(json.dumps(spec))
    os.environ["JUPYTER_PATH"] = str(root / "jupyter" / "share" / "jupyter")


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


def machine() -> str:
    """The CPU, its cores and its widest vector unit: what the figures above are of."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    simd = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    return f"{model}, {os.cpu_count()} cores, {simd}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    parts = ["embedded", "attach", "warm"]
    ap.add_argument("--parts", nargs="+", default=parts, choices=parts, help="which measures (default: all)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="startup_"))
    # embedded first, with no other Ray cluster on the machine (a user's case): a second cluster beside it
    # slows an embedded start by ~6 s here (its ray.init waits twice as long for its raylet and API server)
    rows = []
    for rep in range(args.reps if "embedded" in args.parts else 0):  # ours and its floor alternate: a slow
        rows.append({"what": "embedded", **embedded(root, rep)})     # minute of the machine hits both
        rows.append({"what": "embedded floor", **child(["floor-embedded", *TINY], root / f"floor-e-{rep}.json")})
    if "attach" in args.parts:
        rows += attach_on_a_head(root, args.reps)
    if "warm" in args.parts:
        import rlbench_nb as rl
        from rlbench_nb.data.tasks import load_task
        from rlbench_nb.prompts import load_tokenizer
        model_dir = str(load_task(rl.Config.load(None, TINY)).model_dir)
        kernelspecs(root)
        rows += warm(root, args.reps, (model_dir, type(load_tokenizer(model_dir)).__name__))
    table(rows, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def attach_on_a_head(root: Path, reps: int) -> list[dict]:
    rows = []
    head, address = ray_head()
    try:
        child(["resident", "startup-resident", address], root / "resident.json")
        for rep in range(reps):
            rows.append({"what": "attach", **attach(root, rep, address)})
            rows.append({"what": "attach floor",
                         **child(["floor-attach", "startup-resident", address], root / f"floor-a-{rep}.json")})
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head this started, and only it
        head.wait(timeout=60)
    return rows


def table(rows: list[dict], reps: int) -> None:
    print(f"\nstart-up, median of {reps} (fresh processes; tiny config, Ray, one thread per actor; {machine()})")
    print(f"{'what':<22} {'imports s':>9} {'session s':>9} {'work s':>7} {'total s':>8} {'x floor':>8}   "
          "session = Session() / attach / the floor's ray.init; work = first rollout / first step / the floor's call;"
          " warm: x its attach floor / x its controller floor; kernels: imports = from asking Jupyter for a kernel to"
          " the cell's imports done; warm kernel: x the kernel attach floor / x the process attach floor")
    kinds = [w for w in ("embedded", "embedded floor", "attach", "attach floor", "warm", "warm: attach floor",
                         "warm: controller floor", "warm kernel", "kernel: attach floor")
             if any(r["what"] == w for r in rows)]
    med = {w: {k: statistics.median(r[k] for r in rows if r["what"] == w) for k in ("imports_s", "session_s", "work_s")}
           for w in kinds}
    total = {w: statistics.median(r["imports_s"] + r["session_s"] + r["work_s"] for r in rows if r["what"] == w)
             for w in kinds}
    for w in kinds:
        floor = {"warm": "warm: attach floor", "warm kernel": "kernel: attach floor"}.get(w, w + " floor")
        ratio = "" if w.endswith("floor") else f"{total[w] / total[floor]:.2f}"
        if w == "warm":
            ratio += f" / {total[w] / total['warm: controller floor']:.2f}"
        if w == "warm kernel":  # and against the process attach floor above, as the warm row
            ratio += f" / {total[w] / total['warm: attach floor']:.2f}"
        print(f"{w:<22} {med[w]['imports_s']:>9.1f} {med[w]['session_s']:>9.1f} {med[w]['work_s']:>7.2f} "
              f"{total[w]:>8.1f} {ratio:>11}")


if __name__ == "__main__":
    main()
