"""Train-inference mismatch: how far the rollout engine's sampler log-probs are from the trainer's for the
same tokens, and the importance-sampling corrections for it (verl's rollout correction, TRL's
`vllm_importance_sampling_*`).

    m = mismatch_metrics(rollout_logprobs_BR, trainer_logprobs_BR, mask_BR)
    weights_BR, stats = rollout_is_weights(trainer_logprobs_BR, rollout_logprobs_BR, mask_BR, "tis", cap=2.0)

The engine sampled from q (its log-probs), the trainer's policy is p (old log-probs: the weights that
sampled, as the trainer computes them). Δ = log p - log q per token; with an exact engine Δ = 0.
"""
from __future__ import annotations

import math

import torch

from .masked import masked_mean


def mismatch_metrics(rollout_logprobs_BR: torch.Tensor, trainer_logprobs_BR: torch.Tensor,
                     mask_BR: torch.Tensor) -> dict[str, float]:
    """mismatch/logp_abs_mean and _max: |Δ| over response tokens; mismatch/prob_ratio_err: the mean over
    sequences of |exp(mean_t Δ) - 1| (NeMo-RL's token_mult_prob_error); mismatch/kl_k3: KL(q || p) by the
    k3 estimator on the engine's samples, mean of (r - 1 - log r) with r = p / q."""
    mask = mask_BR.float()
    delta = (trainer_logprobs_BR.float() - rollout_logprobs_BR.float()).clamp(-20, 20) * mask
    per_seq = delta.sum(-1) / mask.sum(-1).clamp(min=1)
    has_tokens = mask.sum(-1) > 0
    ratio = torch.exp(delta)
    return {
        "mismatch/logp_abs_mean": masked_mean(delta.abs(), mask).item(),
        "mismatch/logp_abs_max": (delta.abs() * mask).max().item() if mask.any() else 0.0,
        "mismatch/prob_ratio_err": (torch.exp(per_seq) - 1).abs()[has_tokens].mean().item() if has_tokens.any()
        else 0.0,
        "mismatch/kl_k3": masked_mean(ratio - 1 - delta, mask).item(),
    }


def rollout_is_weights(trainer_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor,
                       mask_BR: torch.Tensor, mode: str, cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights for the policy loss correcting for sampling from q instead of p (no gradient):

    - "tis": token-level truncated importance sampling, w_t = min(p_t / q_t, cap);
    - "mis": sequence-level masked importance sampling: a sequence whose ratio prod_t p_t / q_t leaves
      [1/cap, cap] gets weight 0 (masked), the others weight 1;
    - "off": all ones.
    Stats: mismatch/is_capped_frac (tokens whose ratio was above cap) or mismatch/is_masked_frac (sequences
    masked), and mismatch/is_weight_mean."""
    mask = mask_BR.float()
    log_ratio = ((trainer_logprobs_BR.float() - rollout_logprobs_BR.float()) * mask).clamp(-20, 20)
    if mode == "off":
        return torch.ones_like(mask), {}
    if mode == "tis":
        ratio = torch.exp(log_ratio)
        weights = ratio.clamp(max=cap) * mask
        stats = {"mismatch/is_capped_frac": masked_mean((ratio > cap).float(), mask).item()}
    elif mode == "mis":
        seq_log_ratio = log_ratio.sum(-1)
        keep = (seq_log_ratio.abs() <= math.log(cap)).float()
        weights = keep[:, None] * mask
        stats = {"mismatch/is_masked_frac": 1.0 - keep.mean().item()}
    else:
        raise ValueError(f"unknown rollout correction '{mode}': use off, tis or mis")
    stats["mismatch/is_weight_mean"] = masked_mean(weights, mask).item()
    return weights.detach(), stats
