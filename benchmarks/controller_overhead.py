"""Controller overhead per backend: start-up, empty call round trip, weight sync, and its share of a step.

    python benchmarks/controller_overhead.py            # local, ray, ray-colocated
    python benchmarks/controller_overhead.py --calls 20 --steps 30 --json out.json

`empty call`: a worker method that does nothing but report memory, called on every rank of the policy
group (median over --calls). `sync`: policy -> rollout weight push, against a plain in-process copy of
the same tensors. `overhead %`: over --steps GRPO steps of the tiny config (the issue's yardstick: 8
prompts x 8 samples, <= 8 new tokens), the share of each step's wall time not spent inside a worker
method: dispatch, (de)serialisation, the controller's own bookkeeping (decode, advantages, metrics).
`ray floor` (Ray backends): the same step's calls — generate, score, update with the weight push queued
behind it (policy -> rollout by reference, as workers.start_sync does) — on bare Ray actors that only spin
for each call's measured median seconds, with nothing in between: what Ray's dispatch alone costs this
call pattern on this machine, in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import transformers

import rlbench_nb as rl

BACKENDS = {"local": ["cluster.backend=local"], "ray": ["cluster.backend=ray"],
            "ray-colocated": ["cluster.backend=ray", "rollout.colocate=true"]}
TINY = ["data.batch_size=8", "rollout.n=8", "rollout.max_new_tokens=8", "algo.reuse_logprobs=true",
        "train.micro_batch_size=4096", "run.save_rollouts_every=0", "cluster.num_threads=2"]


def step_overhead(sess, steps: int) -> tuple[float, float, dict]:
    """(median step seconds, median share of it outside worker methods, (role, method) -> median seconds
    inside it)."""
    walls, shares, works = [], [], {}
    for i in range(steps + 3):
        t0 = time.perf_counter()
        sess.step()
        t1 = time.perf_counter()
        if i < 3:
            continue  # warm-up
        calls = {}  # (role, method, start) -> slowest rank's seconds inside the method
        for g in sess.groups.values():
            for r in g.records:
                if r.start >= t0:
                    key = (r.role, r.method, r.start)
                    calls[key] = max(calls.get(key, 0.0), r.work_s)
        for (role, method, _), work_s in calls.items():
            works.setdefault((role, method), []).append(work_s)
        inside = sum(calls.values())
        walls.append(t1 - t0)
        shares.append(max(0.0, (t1 - t0 - inside) / (t1 - t0)))
    return statistics.median(walls), statistics.median(shares), {k: statistics.median(v) for k, v in works.items()}


class Spinner:
    """A bare actor: holds a core for the seconds it is told, returns nothing of size."""

    def spin(self, seconds: float, *_deps) -> int:
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass
        return 0


def ray_floor(works: dict, steps: int) -> tuple[float, float]:
    """(median step seconds, share outside the calls) of the default step's call pattern on bare actors."""
    import ray
    rollout, reward, policy = (ray.remote(Spinner).options(num_cpus=0).remote() for _ in range(3))
    w = {k[1]: v for k, v in works.items()}
    inside = w["generate"] + w["score"] + w["update"] + w["get_weights"] + w["set_weights"]
    walls = []
    for _ in range(steps + 3):
        t0 = time.perf_counter()
        ray.get(rollout.spin.remote(w["generate"]))
        ray.get(reward.spin.remote(w["score"]))
        update = policy.spin.remote(w["update"])
        weights = policy.spin.remote(w["get_weights"])
        ray.get([update, weights, rollout.spin.remote(w["set_weights"], weights)])
        walls.append(time.perf_counter() - t0)
    for a in (rollout, reward, policy):
        ray.kill(a)
    wall = statistics.median(walls[3:])
    return wall, max(0.0, (wall - inside) / wall)


def measure(backend: str, calls: int, steps: int) -> dict:
    cfg = rl.Config.load(None, [f"run.dir={tempfile.mkdtemp()}", "run.tensorboard=false", "task.num_test=20",
                                *BACKENDS[backend], *TINY])
    t0 = time.perf_counter()
    if cfg.cluster.backend == "ray":
        from rlbench_nb.cluster.ray_connect import attach
        attach(cfg)
    cluster_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sess = rl.Session(cfg)
    session_s = time.perf_counter() - t0
    group = sess.groups["policy"]
    group.call("memory")
    rtt = []
    for _ in range(calls):
        t = time.perf_counter()
        group.call("memory")
        rtt.append(time.perf_counter() - t)
    syncs = [sess.sync_weights() for _ in range(5)]
    sync_s = statistics.median(s["sync/s"] for s in syncs)
    weights = sess.groups["policy"].call("get_weights")[0]
    t = time.perf_counter()
    for _ in range(5):
        {k: v.clone() for k, v in weights.items()}
    copy_s = (time.perf_counter() - t) / 5
    step_s, share, works = step_overhead(sess, steps)
    pushes = sess.groups["policy"].last_transport != "here" if cfg.cluster.backend == "ray" else False
    sess.close()
    nbytes = syncs[0]["sync/bytes"]
    floor_s, floor_share = ray_floor(works, steps) if pushes else (None, None)
    return {"backend": backend, "cluster_start_s": cluster_s, "session_start_s": session_s,
            "empty_call_ms": 1e3 * statistics.median(rtt), "sync_s": sync_s, "sync_MB_s": nbytes / sync_s / 1e6,
            "copy_MB_s": nbytes / copy_s / 1e6, "bytes": nbytes, "step_s": step_s, "overhead_share": share,
            "floor_step_s": floor_s, "floor_overhead_share": floor_share}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--json")
    args = p.parse_args()
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    rows = [measure(b, args.calls, args.steps) for b in args.backends]
    print(f"\n{'backend':<14} {'cluster s':>9} {'session s':>9} {'empty call ms':>13} {'sync ms':>8} "
          f"{'sync MB/s':>9} {'copy MB/s':>9} {'step ms':>8} {'overhead %':>10} {'ray floor ms':>12} {'floor %':>8}")
    for r in rows:
        print(f"{r['backend']:<14} {r['cluster_start_s']:>9.1f} {r['session_start_s']:>9.1f} "
              f"{r['empty_call_ms']:>13.2f} {1e3 * r['sync_s']:>8.1f} {r['sync_MB_s']:>9.0f} {r['copy_MB_s']:>9.0f} "
              f"{1e3 * r['step_s']:>8.1f} {100 * r['overhead_share']:>9.0f}% "
              + (f"{1e3 * r['floor_step_s']:>12.1f} {100 * r['floor_overhead_share']:>7.0f}%"
                 if r["floor_step_s"] else f"{'-':>12} {'-':>8}"))
    print(f"weights: {rows[0]['bytes'] / 1e6:.1f} MB; step: tiny config, 64 completions x <= 8 tokens")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
