"""Sync vs async `run()` with bounded staleness on the Ray backend: step time, overlap, idle shares.

    python benchmarks/async_overlap.py                 # defaults: 12 steps each, 2 policy ranks, k = 0, 1, 2
    python benchmarks/async_overlap.py --steps 3 --staleness 0 1 --json out.json

Each `--staleness` k runs `run(async_rollout=True, max_staleness=k)` (0: the synchronous loop). Prints a
table (median step seconds, rollout and update seconds, the share of rollout time that ran concurrently
with other roles' work, from the phase timeline, the mean staleness of the trained batches, and the median
share of a step the rollout and the policy ranks sat idle) and writes JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import transformers

import rlbench_nb as rl
from rlbench_nb.metrics.timeline import overlap_fraction


def measure(k: int, steps: int, overrides: list[str]) -> dict:
    cfg = rl.Config.load(None, overrides)
    sess = rl.Session(cfg)
    sess.step()  # warm-up (first calls are slower)
    since = time.perf_counter()
    start_len = len(sess.history)
    sess.run(steps, progress=False, async_rollout=True, max_staleness=k)
    rows = sess.history[start_len:]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)
    out = {"mode": "sync" if k == 0 else f"async k={k}", "max_staleness": k, "steps": steps,
           "step_s": median("time/step_s"), "rollout_s": median("time/rollout_s"),
           "update_s": median("time/update_s"), "overlap": overlap_fraction(sess.groups, since),
           "staleness": statistics.mean(r.get("async/staleness", 0.0) for r in rows),
           "rollout_idle": median("async/rollout_idle"), "trainer_idle": median("async/trainer_idle"),
           "reward_last": rows[-1]["reward/mean"]}
    sess.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="max_staleness values (0: sync)")
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*", help="config overrides")
    args = p.parse_args()
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    base = [f"run.dir={tempfile.mkdtemp()}", "run.tensorboard=false", "run.save_rollouts_every=0",
            "cluster.backend=ray", "cluster.train_ranks=2", "cluster.num_threads=1", "task.num_test=50",
            "data.batch_size=32", "rollout.n=8", *args.overrides]
    results = [measure(k, args.steps, base) for k in args.staleness]
    print(f"\n{'mode':<10} {'step s':>8} {'rollout s':>10} {'update s':>9} {'overlap':>8} {'staleness':>10} "
          f"{'rollout idle':>13} {'trainer idle':>13}")
    for r in results:
        idle = (f"{r['rollout_idle']:>13.0%} {r['trainer_idle']:>13.0%}" if r["max_staleness"] else
                f"{'-':>13} {'-':>13}")
        print(f"{r['mode']:<10} {r['step_s']:>8.3f} {r['rollout_s']:>10.3f} {r['update_s']:>9.3f} "
              f"{r['overlap']:>8.0%} {r['staleness']:>10.2f} {idle}")
    sync = next((r for r in results if r["max_staleness"] == 0), None)
    for r in results:
        if sync is not None and r is not sync:
            gain = 1 - r["step_s"] / sync["step_s"]
            print(f"{r['mode']} step time vs sync: {gain:+.0%} shorter" if gain >= 0 else
                  f"{r['mode']} is {-gain:.0%} slower than sync")
    if args.json:
        json.dump({"results": results}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
