"""GPU smoke: a few GRPO steps of a Qwen2-0.5B-shaped model on one GPU, bf16, local backend.

    python benchmarks/gpu_smoke.py                      # ~2-3 min on an H100/H200, < 5 min on smaller GPUs
    python benchmarks/gpu_smoke.py --tiny --steps 1     # the same code path on CPU in seconds (CI smoke)

For a machine with torch, transformers and triton only (no ray, no vllm): it uses the `local` backend.
The model is built from a config with random weights (speed needs no pretrained weights) and the
built-in task's prompts and tokenizer; with random weights rewards are ~0, so this measures speed and
memory, not learning. What it exercises: bf16 compute with fp32 master weights (autocast, since one
process has no FSDP), the chunked log-prob/entropy op (Triton kernel on CUDA), HF generate with KV cache.

Prints tokens/s per phase, training MFU (6 x params x tokens per second against the GPU's bf16 dense
peak; `--peak-tflops` for GPUs not in the table) and peak memory; writes JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

# bf16 dense peak, TFLOPS (no sparsity), by a substring of torch.cuda.get_device_name()
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}

QWEN2_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True)


def build_model_dir(path: Path, shape: dict) -> int:
    """A Qwen2 model (random init) + the built-in task's tokenizer, saved as a local HF dir. Returns params."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlbench_nb.data.tasks.arithmetic import make_tokenizer
    tok = make_tokenizer(path)
    cfg = Qwen2Config(**shape, max_position_embeddings=512, rope_theta=1e6, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def peak_tflops(override: float | None) -> float | None:
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: the same path on CPU, for CI")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.prompts, args.n, args.max_new_tokens = min(args.prompts, 4), min(args.n, 2), min(args.max_new_tokens, 8)

    import transformers
    transformers.logging.set_verbosity_error()
    import rlbench_nb as rl

    tmp = Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    t0 = time.perf_counter()
    n_params = build_model_dir(tmp / "model", TINY if args.tiny else QWEN2_0_5B)
    build_s = time.perf_counter() - t0
    cfg = rl.Config.load(None, [
        f"run.dir={tmp / 'runs'}", "run.tensorboard=false", "run.save_rollouts_every=0", "task.num_test=8",
        f"model.path={tmp / 'model'}", f"model.dtype={args.dtype}", "algo.kl_coef=0.0",
        f"data.batch_size={args.prompts}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.micro_batch_size=512", "train.micro_batch_size=128", "train.lr=1e-6"])
    sess = rl.Session(cfg)
    sess.step()  # warm-up: CUDA context, kernel autotune, allocator
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    rows = [sess.step() for _ in range(args.steps)]
    gpu_peak_gb = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    sess.close()

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], (int, float))}
    achieved = 6 * n_params * med["throughput/update_tok_s"] / 1e12  # forward + backward FLOPs per token
    peak = peak_tflops(args.peak_tflops)
    out = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "params_m": n_params / 1e6, "dtype": args.dtype, "completions_per_step": args.prompts * args.n,
        "max_new_tokens": args.max_new_tokens, "steps": args.steps, "build_s": build_s,
        "step_s": med["time/step_s"],
        "rollout_s": med["time/rollout_s"], "rollout_tok_s": med["throughput/rollout_tok_s"],
        "prepare_s": med["time/prepare_s"], "prepare_tok_s": med["throughput/prepare_tok_s"],
        "update_s": med["time/update_s"], "update_tok_s": med["throughput/update_tok_s"],
        "train_tflops": achieved, "train_mfu": (achieved / peak) if peak else None,
        "gpu_peak_gb": gpu_peak_gb, "cpu_peak_rss_gb": med.get("memory/policy_peak_gb"),
    }
    print(f"\n{out['device']}: {out['params_m']:.0f}M params, {args.dtype}, {out['completions_per_step']} completions "
          f"x <= {args.max_new_tokens} new tokens per step, median of {args.steps} steps")
    print(f"{'phase':<10}{'seconds':>10}{'tokens/s':>14}")
    for phase, unit in (("rollout", "completion"), ("prepare", "all"), ("update", "all")):
        print(f"{phase:<10}{out[f'{phase}_s']:>10.3f}{out[f'{phase}_tok_s']:>14,.0f}   ({unit} tokens)")
    print(f"{'step':<10}{out['step_s']:>10.3f}")
    mfu = f"{out['train_mfu']:.1%}" if out["train_mfu"] is not None else "n/a (unknown peak; --peak-tflops)"
    print(f"training: {achieved:.1f} TFLOPS achieved, MFU {mfu}")
    if gpu_peak_gb is not None:
        print(f"GPU peak memory allocated: {gpu_peak_gb:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
