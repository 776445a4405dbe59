"""Sync vs one-step-off-policy async `run()` on the Ray backend: step time and overlap.

    python benchmarks/async_overlap.py                 # defaults: 12 steps each, 2 policy ranks
    python benchmarks/async_overlap.py --steps 3 --json out.json

Prints a table (median step seconds, rollout and update seconds, the share of rollout time that ran
concurrently with other roles' work, from the phase timeline) and writes JSON with --json.
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


def measure(mode: str, steps: int, overrides: list[str]) -> dict:
    cfg = rl.Config.load(None, overrides)
    sess = rl.Session(cfg)
    sess.step()  # warm-up (first calls are slower)
    since = time.perf_counter()
    start_len = len(sess.history)
    sess.run(steps, progress=False, async_rollout=(mode == "async"))
    rows = sess.history[start_len:]
    out = {"mode": mode, "steps": steps,
           "step_s": statistics.median(r["time/step_s"] for r in rows),
           "rollout_s": statistics.median(r["time/rollout_s"] for r in rows),
           "update_s": statistics.median(r["time/update_s"] for r in rows),
           "overlap": overlap_fraction(sess.groups, since),
           "reward_last": rows[-1]["reward/mean"]}
    sess.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*", help="config overrides")
    args = p.parse_args()
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    base = [f"run.dir={tempfile.mkdtemp()}", "run.tensorboard=false", "run.save_rollouts_every=0",
            "cluster.backend=ray", "cluster.train_ranks=2", "cluster.num_threads=1", "task.num_test=50",
            "data.batch_size=32", "rollout.n=8", *args.overrides]
    results = [measure(mode, args.steps, base) for mode in ("sync", "async")]
    print(f"\n{'mode':<6} {'step s':>8} {'rollout s':>10} {'update s':>9} {'overlap':>8}")
    for r in results:
        print(f"{r['mode']:<6} {r['step_s']:>8.3f} {r['rollout_s']:>10.3f} {r['update_s']:>9.3f} {r['overlap']:>8.0%}")
    gain = 1 - results[1]["step_s"] / results[0]["step_s"]
    print(f"async step time vs sync: {gain:+.0%} shorter" if gain >= 0 else f"async is {-gain:.0%} slower")
    if args.json:
        json.dump({"results": results, "async_gain": gain}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
