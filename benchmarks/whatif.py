"""What the research loop costs on the built-in task: snapshot + restore, a replay of one batch under two
settings with the comparison table, and re-scoring saved rollouts.

    python benchmarks/whatif.py                         # local, and Ray with 2 FSDP ranks
    python benchmarks/whatif.py --backends local --reps 3 --json out.json
    python benchmarks/whatif.py --backends local --reps 1 data.batch_size=8   # config overrides last

The batch is the issue's yardstick: 256 samples (64 prompts x 4). `snapshot+restore` is one snapshot
and one restore of the whole session (policy weights, optimizer, RNG; engine re-synced), median of
--reps; `replay x2 + table` replays the same saved batch under two clip settings and builds the
comparison table; `re-score` scores the 256 saved samples again with a new reward function (in worker
processes under the local backend: reward.isolation=auto).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import transformers

import rlbench_nb as rl

BACKENDS = {"local": ["cluster.backend=local"],
            "ray-2-ranks": ["cluster.backend=ray", "cluster.train_ranks=2", "cluster.num_threads=1"]}
WORKLOAD = ["data.batch_size=64", "rollout.n=4", "run.save_rollouts_every=1", "run.tensorboard=false",
            "task.num_test=20"]


def shorter_is_better(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer) - 0.01 * len(response)


def measure(backend: str, reps: int, overrides: list[str]) -> dict:
    cfg = rl.Config.load(None, [f"run.dir={tempfile.mkdtemp()}", *BACKENDS[backend], *WORKLOAD, *overrides])
    with rl.Session(cfg) as sess:
        sess.step()
        sess.step()
        snaps, restores = [], []
        for _ in range(reps):
            t = time.perf_counter()
            snap = sess.snapshot()
            snaps.append(time.perf_counter() - t)
            sess.step()
            t = time.perf_counter()
            sess.restore(snap)
            restores.append(time.perf_counter() - t)
            snap.release()
        saved = rl.load_rollouts(sess.run_dir / "rollouts" / "step_000002.jsonl")
        replays = []
        for _ in range(reps):
            t = time.perf_counter()
            a = sess.replay(saved, "algo.clip_high=0.2", name="clip-0.2")
            b = sess.replay(saved, "algo.clip_high=0.28", name="clip-0.28")
            sess.compare(a, b).table()
            replays.append(time.perf_counter() - t)
        sess.set_reward(shorter_is_better)
        sess.score(saved)  # the first call starts the isolation processes
        rescores = []
        for _ in range(reps):
            t = time.perf_counter()
            sess.score(saved)
            rescores.append(time.perf_counter() - t)
        return {"backend": backend, "samples": len(saved), "snapshot_s": statistics.median(snaps),
                "restore_s": statistics.median(restores), "replay2_table_s": statistics.median(replays),
                "rescore_s": statistics.median(rescores), "snapshot_MB": snap.bytes / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*", help="config overrides after the workload's (section.key=value)")
    args = p.parse_args()
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    rows = [measure(b, args.reps, args.overrides) for b in args.backends]
    print(f"\n{'backend':<12} {'samples':>7} {'snapshot s':>10} {'restore s':>9} {'snap+restore s':>14} "
          f"{'replay x2 + table s':>19} {'re-score s':>10} {'snapshot MiB':>12}")
    for r in rows:
        print(f"{r['backend']:<12} {r['samples']:>7} {r['snapshot_s']:>10.3f} {r['restore_s']:>9.3f} "
              f"{r['snapshot_s'] + r['restore_s']:>14.3f} {r['replay2_table_s']:>19.2f} {r['rescore_s']:>10.3f} "
              f"{r['snapshot_MB']:>12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
