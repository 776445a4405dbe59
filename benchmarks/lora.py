"""LoRA vs the whole model, both with a KL reference (algo.kl_coef=0.05): memory and step time.

    python benchmarks/lora.py                          # 20m and 100m Llamas, 2 alternating repetitions
    python benchmarks/lora.py --sizes 20m --steps 2 --reps 1 --json out.json

Each setting runs in a fresh process (the local backend: every role in it), so its peak RSS is the whole
session's: policy, reference (full model: a second copy; LoRA: none, the policy with its adapters off),
rollout engine, optimizer state and activations. Beside it, what the workers' tensors add up to: policy
weights, the trained share, gradients and AdamW state, and the reference's weights. The same model
(random init from a config, the built-in character tokenizer), prompts, sampling and seed on both sides;
LoRA r=16, alpha=32 on every linear layer.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # name: Llama shape (vocab: the task's characters)
    "20m": dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536),
    "100m": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048),
}
MODES = {"full": ["model.lora.r=0", "train.lr=1e-5"],
         "lora": ["model.lora.r=16", "model.lora.alpha=32", "train.lr=1e-4"]}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def child(size: str, mode: str, steps: int, warmup: int, root: Path) -> dict:
    import torch

    import rlbench_nb as rl
    from rlbench_nb.config import ModelConfig
    from rlbench_nb.data.tasks.arithmetic import make_model, make_tokenizer
    path = root / size
    if not (path / "config.json").exists():
        tok = make_tokenizer(path)
        make_model(ModelConfig(**SIZES[size]), len(tok), seed=0).save_pretrained(str(path))
    cfg = rl.Config.load(None, [
        f"run.dir={root / 'runs'}", "run.tensorboard=false", "run.save_rollouts_every=0", f"model.path={path}",
        "data.batch_size=8", "rollout.n=4", "rollout.max_new_tokens=16", "algo.kl_coef=0.05", "task.num_test=8",
        "train.micro_batch_size=32", *MODES[mode]])
    sess = rl.Session(cfg)
    walls, rows = [], []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        rows.append(sess.step())
        walls.append(time.perf_counter() - t0)
    policy = sess.groups["policy"].workers[0]
    params = list(policy.model.parameters())
    trained = [p for p in params if p.requires_grad]
    optim = [v for s in policy.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    reference = _bytes(sess.groups["reference"].workers[0].model.parameters()) if "reference" in sess.groups else 0
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    out = {"step_s": statistics.median(walls[warmup:]), "peak_rss_gb": peak_gb,
           "policy_gb": _bytes(params) / 2**30, "trained_gb": _bytes(trained) / 2**30,
           "grads_optim_gb": (_bytes(trained) + _bytes(optim)) / 2**30, "reference_gb": reference / 2**30,
           "sync_mb": rows[-1]["sync/bytes"] / 2**20, "params_m": sum(p.numel() for p in params) / 1e6}
    sess.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.warmup, Path(args.root))))
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes:
            for _ in range(args.reps):
                for mode in MODES:  # alternating: machine noise hits both
                    out = subprocess.run([sys.executable, __file__, "--child", size, mode, "--root", root,
                                          "--steps", str(args.steps), "--warmup", str(args.warmup)],
                                         check=True, capture_output=True, text=True).stdout
                    results.setdefault(size, {}).setdefault(mode, []).append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'size':<6}{'mode':<6}{'params':>8}{'trained':>10}{'grads+adam':>12}{'reference':>11}"
          f"{'peak RSS':>10}{'s/step':>8}{'sync':>9}")
    for size, modes in results.items():
        for mode, reps in modes.items():
            r = reps[0]
            rss = statistics.median(x["peak_rss_gb"] for x in reps)
            step = statistics.median(x["step_s"] for x in reps)
            print(f"{size:<6}{mode:<6}{r['params_m']:>7.1f}M{r['trained_gb']:>8.3f}GB{r['grads_optim_gb']:>10.3f}GB"
                  f"{r['reference_gb']:>9.3f}GB{rss:>8.2f}GB{step:>8.2f}{r['sync_mb']:>7.0f}MB")
        full, lora = (statistics.median(x["peak_rss_gb"] for x in modes[m]) for m in ("full", "lora"))
        print(f"{size:<6}LoRA saves {full - lora:.2f} GB of peak RSS ({1 - lora / full:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
