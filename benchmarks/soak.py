"""Soak: a long background run of the tiny task with the dashboard attached; RSS of the controller and of
every worker process over time. What it checks by eye: memory levels off (bounded histories), it does not
climb with the step count.

    python benchmarks/soak.py                       # 1,000 steps, local backend
    python benchmarks/soak.py --backend ray         # workers in Ray actors: their RSS is read by pid
    python benchmarks/soak.py --steps 5 --json out.json

Runs `sess.run(steps, background=True)` under an asyncio loop (as a Jupyter kernel would), with
`sess.dashboard()` receiving every step, and samples memory every `--every` steps.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import psutil


def rss_mb(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


async def soak(steps: int, every: int, backend: str) -> list[dict]:
    import rlbench_nb as rl
    cfg = rl.Config.load(None, [f"run.dir={tempfile.mkdtemp()}", "data.batch_size=8", "rollout.n=4", "task.num_test=40",
                                "run.save_rollouts_every=0", "run.tensorboard=false", f"cluster.backend={backend}",
                                "cluster.num_threads=1"])
    sess = rl.Session(cfg)
    dash = sess.dashboard()  # attached: redraws on every step
    workers = {f"{role}{rank}": info["pid"] for role, g in sess.groups.items() for rank, info in g.info.items()
               if info["pid"] != os.getpid()}
    samples: list[dict] = []

    def sample():
        row = {"step": sess.step_count, "t_s": time.perf_counter() - t0, "controller_mb": rss_mb(os.getpid()),
               "history_rows": len(sess.history),
               "call_records": sum(len(g.records) for g in sess.groups.values())}
        row.update({f"{name}_mb": rss_mb(pid) for name, pid in workers.items()})
        samples.append(row)

    t0 = time.perf_counter()
    sample()
    run = sess.run(steps, background=True)
    next_at = every
    while not run.done:
        await asyncio.sleep(0.05)
        if sess.step_count >= next_at:
            sample()
            next_at += every
    await run
    sample()
    del dash
    sess.close()
    return samples


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100, help="sample memory every this many steps")
    ap.add_argument("--backend", default="local", choices=["local", "ray"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    samples = asyncio.run(soak(args.steps, max(1, min(args.every, args.steps)), args.backend))
    cols = [k for k in samples[0] if k.endswith("_mb")]
    print(f"\nsoak: {args.steps} steps, {args.backend} backend, dashboard attached; RSS in MiB")
    print(f"{'step':>6}{'min':>7}" + "".join(f"{c[:-3]:>12}" for c in cols) + f"{'history':>9}{'records':>9}")
    for s in samples:
        print(f"{s['step']:>6}{s['t_s'] / 60:>7.1f}" + "".join(f"{s[c]:>12.0f}" for c in cols)
              + f"{s['history_rows']:>9}{s['call_records']:>9}")
    mid = samples[len(samples) // 2]
    growth = {c: samples[-1][c] - mid[c] for c in cols}
    print("growth over the second half: " + ", ".join(f"{c[:-3]} {v:+.0f} MiB" for c, v in growth.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "second_half_growth_mb": growth}, indent=1))


if __name__ == "__main__":
    main()
