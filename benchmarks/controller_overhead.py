"""Controller overhead per backend: embedded Ray start-up, empty call round trip, weight sync.

    python benchmarks/controller_overhead.py            # both backends
    python benchmarks/controller_overhead.py --calls 20 --json out.json

`empty call`: a worker method that does nothing but report memory, called on every rank of the policy
group (median over --calls). `sync`: policy -> rollout weight push, against a plain in-process copy of
the same tensors.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import transformers

import rlbench_nb as rl


def measure(backend: str, calls: int) -> dict:
    cfg = rl.Config.load(None, [f"run.dir={tempfile.mkdtemp()}", "run.tensorboard=false", "task.num_test=20",
                                f"cluster.backend={backend}", "cluster.num_threads=1"])
    t0 = time.perf_counter()
    if backend == "ray":
        from rlbench_nb.cluster.ray_backend import attach
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
    sess.close()
    nbytes = syncs[0]["sync/bytes"]
    return {"backend": backend, "cluster_start_s": cluster_s, "session_start_s": session_s,
            "empty_call_ms": 1e3 * statistics.median(rtt), "sync_s": sync_s, "sync_MB_s": nbytes / sync_s / 1e6,
            "copy_MB_s": nbytes / copy_s / 1e6, "bytes": nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--json")
    args = p.parse_args()
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    rows = [measure(b, args.calls) for b in ("local", "ray")]
    print(f"\n{'backend':<7} {'cluster s':>9} {'session s':>9} {'empty call ms':>13} {'sync s':>7} "
          f"{'sync MB/s':>9} {'copy MB/s':>9}")
    for r in rows:
        print(f"{r['backend']:<7} {r['cluster_start_s']:>9.1f} {r['session_start_s']:>9.1f} {r['empty_call_ms']:>13.2f} "
              f"{r['sync_s']:>7.3f} {r['sync_MB_s']:>9.0f} {r['copy_MB_s']:>9.0f}")
    print(f"weights: {rows[0]['bytes'] / 1e6:.1f} MB")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
