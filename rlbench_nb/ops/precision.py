"""Which dtype the rollout engine computes in, on this machine: bf16 where the CPU multiplies it in hardware.

    rollout_dtype(cfg, "cpu", params=135e6)  # 'bfloat16' under rollout.dtype=auto on an AVX512-BF16 / AMX CPU

Decode on a CPU is matmuls of a few rows against every weight. A CPU with AVX512-BF16 (or AMX) runs bf16
F.linear 2-3x faster than fp32 at SmolLM2-135M's shapes and reads half the bytes; one with AVX2 only emulates
bf16, at about half fp32's speed (benchmarks/README.md, the rollout's table). The trainers keep model.dtype: the
engine's log-probs then differ from the trainer's by bf16's rounding, which algo.mismatch_alarm watches and
algo.rollout_is corrects.
"""
from __future__ import annotations

import torch


def native_bf16() -> bool:
    """This CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): there bf16 matmuls run 2-3x fp32's. An AVX2 CPU
    emulates them, at about half fp32's speed (benchmarks/README.md, the rollout's table)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# below this the weights sit in the CPU's caches and bf16's extra casts cost more than its matmuls save: on the
# 2-core EPYC with AVX512-BF16 the HF engine decoded a 0.9M-parameter model at 0.7-1.0x fp32's tokens/s, 3.4M at
# 1.2-1.5x, 11.5M 1.6x, 20M 1.75x, SmolLM2-135M 1.5x (2 threads, alternating runs)
BF16_MIN_PARAMS = 2_000_000


def rollout_dtype(cfg, device: torch.device | str, params: int | None = None) -> str:
    """The dtype the rollout engine holds its weights and samples in: rollout.dtype, where 'auto' is bfloat16
    for a float32 model of at least BF16_MIN_PARAMS `params` on a CPU that computes bf16 natively, and
    model.dtype elsewhere (a GPU, an AVX2 CPU, a small model, an engine that does not say its size)."""
    want = cfg.rollout.dtype
    if want == "auto":
        on_cpu = torch.device(device).type == "cpu"
        big = params is not None and params >= BF16_MIN_PARAMS
        return "bfloat16" if cfg.model.dtype == "float32" and on_cpu and big and native_bf16() else cfg.model.dtype
    return cfg.model.dtype if want == "model" else want
