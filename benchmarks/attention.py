"""Attention on a CPU: GRPO steps under `model.attention=auto` (plain attention for calls under 2^20 scores, SDPA
for bigger ones: rlbench_nb/ops/attention.py) vs `sdpa` (transformers' default) vs `eager` (always plain).

    python benchmarks/attention.py                          # tiny and 20m, k3 KL loss, 3 repetitions
    python benchmarks/attention.py --sizes tiny --steps 1 --warmup 0 --reps 1 --json out.json

The work is vs_trl.py's (its docstring lists it: the same models, prompts, sampling and loss; `--kl k3` adds the
reference's forward), on the local backend; only `model.attention` differs. The three settings run alternately in
each repetition, so machine noise hits all three. Reported: median s/step, and the median of each phase that runs
a model (rollout: prefill + one decode call per token; prepare: the reference's forward; update: the policy's
forward + backward), and sdpa's step time over each setting's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import vs_trl

SETTINGS = ("sdpa", "auto", "eager")
PHASES = ("rollout_s", "prepare_s", "update_s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "20m"], choices=list(vs_trl.SIZES))
    ap.add_argument("--kl", default="k3", choices=list(vs_trl.KL))
    args = vs_trl.parse_step_args(ap)  # --steps (20m: at most 2), --warmup (20m: at most 1), --reps, --threads
    root = Path(tempfile.mkdtemp(prefix="attention_"))
    results = []
    for size in args.sizes:
        path = vs_trl.model_dir(size, root)
        steps, warmup = (args.steps, args.warmup) if size == "tiny" else (min(args.steps, 2), min(args.warmup, 1))
        for rep in range(args.reps):
            for setting in SETTINGS:
                r = vs_trl.run_ours(path, size, "local", args.kl, steps, warmup, args.threads,
                                    root / f"{size}-{setting}-{rep}", (f"model.attention={setting}",))
                results.append({"size": size, "attention": setting, "rep": rep, "step_s": r["step_s"],
                                "phases_ms": r["phases_ms"]})
                print(f"{size} {setting} rep {rep}: {r['step_s']:.3f} s/step", flush=True)
    print(f"\nGRPO steps, local backend, KL {args.kl}, {args.threads} threads, median over {args.reps} alternating "
          "reps")
    print(f"{'size':<6}{'attention':<11}{'s/step':>9}" + "".join(f"{p.removesuffix('_s') + ' ms':>13}" for p in PHASES)
          + f"{'sdpa/this':>11}")
    for size in args.sizes:
        med = {}
        for setting in SETTINGS:
            rs = [r for r in results if (r["size"], r["attention"]) == (size, setting)]
            med[setting] = (statistics.median(r["step_s"] for r in rs),
                            [statistics.median(r["phases_ms"][p] for r in rs) for p in PHASES])
        for setting, (s, phases) in med.items():
            print(f"{size:<6}{setting:<11}{s:>9.3f}" + "".join(f"{ms:>13.1f}" for ms in phases)
                  + f"{med['sdpa'][0] / s:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
