"""What `run.deterministic` costs in step time: the default against the deterministic mode, on the same work.

    python benchmarks/determinism.py                                   # tiny model, local and ray, 3 reps
    python benchmarks/determinism.py --sizes 20m --steps 4 --reps 2    # a 20.5M Llama, 256 samples per step

Three settings per backend (each trial in a fresh process: the mode sets process-wide torch state):
- `default`: run.deterministic=false, torch's default thread count (Ray gives each actor OMP_NUM_THREADS=1);
- `deterministic`: run.deterministic=true as a user gets it: every process pinned to cluster.num_threads or 1;
- `deterministic-threads` (shown as "deterministic, N threads"): the same with cluster.num_threads=N (this
  machine's cores): the mode's own cost (deterministic algorithms, per-draw generators), threads put back.
`--settings` picks some of them (the first one chosen is what "vs default" divides by).
The settings alternate rep by rep, so a slower moment of the machine hits each. `s/step` is the median wall
time of whole step() calls after the warm-up steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the same model sizes and work per step as the TRL comparison
from vs_trl import SIZES, data_overrides, model_dir

BACKENDS = {"local": ["cluster.backend=local"], "ray": ["cluster.backend=ray"]}


def settings(cores: int, chosen: list[str]) -> dict[str, list[str]]:
    every = {"default": ("default", ["run.deterministic=false"]),
             "deterministic": ("deterministic", ["run.deterministic=true"]),
             "deterministic-threads": (f"deterministic, {cores} threads",
                                       ["run.deterministic=true", f"cluster.num_threads={cores}"])}
    return dict(every[k] for k in chosen)


def trial(spec: dict) -> dict:
    """One session: warm-up steps, then timed steps (in this process)."""
    import rlbench_nb as rl
    work = SIZES[spec["size"]]
    cfg = rl.Config.load(None, [
        f"run.dir={spec['run_dir']}", "run.tensorboard=false", "run.save_rollouts_every=0",
        f"model.path={spec['path']}",
        f"data.batch_size={work.prompts}", f"rollout.n={work.group}", f"rollout.max_new_tokens={work.max_new}",
        f"train.lr={work.lr}",
        "task.num_test=8", *data_overrides(spec["size"]), *spec["overrides"]])
    with rl.Session(cfg) as sess:
        walls = []
        for _ in range(spec["warmup"] + spec["steps"]):
            t0 = time.perf_counter()
            sess.step()
            walls.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(walls[spec["warmup"]:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["tiny"], choices=list(SIZES))
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settings", nargs="+", choices=["default", "deterministic", "deterministic-threads"],
                    default=["default", "deterministic", "deterministic-threads"])
    ap.add_argument("--json", help="also write the table's rows to this file")
    ap.add_argument("--trial", help=argparse.SUPPRESS)  # internal: run one trial, print its JSON
    args = ap.parse_args()
    if args.trial:
        print(json.dumps(trial(json.loads(args.trial))))
        return
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'size':<6}{'backend':<8}{'setting':<26}{'s/step':>9}{'vs default':>12}   per rep")
        for size in args.sizes:
            path = model_dir(size, Path(tmp))
            for backend in args.backends:
                chosen = settings(cores, args.settings)
                times: dict[str, list[float]] = {name: [] for name in chosen}
                for _ in range(args.reps):
                    for name, overrides in chosen.items():
                        spec = {"size": size, "path": str(path), "run_dir": str(Path(tmp) / "runs"),
                                "overrides": [*BACKENDS[backend], *overrides], "steps": args.steps,
                                "warmup": args.warmup}
                        out = subprocess.run([sys.executable, __file__, "--trial", json.dumps(spec)],
                                             capture_output=True, text=True, check=True)
                        times[name].append(json.loads(out.stdout.strip().splitlines()[-1])["step_s"])
                base = statistics.median(next(iter(times.values())))  # the first setting: default unless left out
                for name, reps in times.items():
                    med = statistics.median(reps)
                    rows.append({"size": size, "backend": backend, "setting": name, "step_s": med,
                                 "vs_default": med / base, "reps": reps})
                    print(f"{size:<6}{backend:<8}{name:<26}{med:>9.3f}{med / base:>11.2f}x   "
                          + " / ".join(f"{r:.3f}" for r in reps))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
