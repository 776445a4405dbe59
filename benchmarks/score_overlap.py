"""The critic's value pass and the reward model's scores: at once (what `score` does) vs one after the other.

    python benchmarks/score_overlap.py                 # defaults: 256 sequences, 7 rounds, Ray backend
    python benchmarks/score_overlap.py --reps 1 data.batch_size=4 --json out.json

PPO with a critic and a reward model of the policy's size (its architecture with a fresh score head), each
role on its own Ray worker. Rounds alternate the two orders on the same batch, so drift in the machine's
speed falls on both; the table gives each order's median seconds and the saving.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import transformers

import rlbench_nb as rl
from rlbench_nb.data.batch import Batch
from rlbench_nb.prompts import reward_inputs


def reward_model_like(policy_dir: Path, out: Path) -> Path:
    """The policy's architecture and tokenizer as a sequence classifier (a fresh one-score head)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    AutoModelForSequenceClassification.from_pretrained(str(policy_dir), num_labels=1).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(policy_dir)).save_pretrained(str(out))
    return out


def one_after_the_other(sess, batch: Batch, inputs: Batch) -> float:
    t0 = time.perf_counter()
    sess.groups["critic"].call_split("compute_values", batch)
    sess.groups["reward_model"].call_split("score", inputs)
    return time.perf_counter() - t0


def at_once(sess, batch: Batch, inputs: Batch) -> float:
    t0 = time.perf_counter()
    values = sess.groups["critic"].submit_shards("compute_values", batch)
    scores = sess.groups["reward_model"].submit_shards("score", inputs)
    sess.groups["critic"].collect(values)
    sess.groups["reward_model"].collect(scores)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*", help="config overrides")
    args = p.parse_args()
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    tmp = Path(tempfile.mkdtemp())
    base = [f"run.dir={tmp}", "run.tensorboard=false", "run.save_rollouts_every=0", "cluster.backend=ray",
            "cluster.num_threads=1", "task.num_test=8", "algo.advantage=gae", "data.batch_size=32", "rollout.n=8",
            *args.overrides]
    probe = rl.Session(rl.Config.load(None, base))  # builds (or finds) the warm-start model the RM copies
    policy_dir = probe.task.model_dir
    probe.close()
    rm = reward_model_like(policy_dir, tmp / "rm")
    sess = rl.Session(rl.Config.load(None, [*base, f"reward.model.path={rm}"]))
    batch = sess.rollout()
    inputs = reward_inputs(batch)
    at_once(sess, batch, inputs)  # warm-up: first calls are slower
    times: dict[str, list[float]] = {"one after the other": [], "at once": []}
    for _ in range(args.reps):
        times["one after the other"].append(one_after_the_other(sess, batch, inputs))
        times["at once"].append(at_once(sess, batch, inputs))
    phase = statistics.median(sess.score(batch).info["metrics"]["time/score_s"] for _ in range(args.reps))
    sess.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{len(batch)} sequences, critic + reward model on their own Ray workers, {args.reps} rounds")
    print(f"{'method':<22} {'median s':>9} {'min s':>7} {'max s':>7}")
    for k, v in times.items():
        print(f"{k:<22} {med[k]:>9.3f} {min(v):>7.3f} {max(v):>7.3f}")
    print(f"{'score phase (+ rule)':<22} {phase:>9.3f}")
    saving = 1 - med["at once"] / med["one after the other"]
    print(f"at once vs one after the other: {saving:+.0%} shorter")
    if args.json:
        json.dump({"sequences": len(batch), "times": times, "median": med, "score_phase_s": phase,
                   "saving": saving}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
