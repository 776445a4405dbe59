"""Policy, value and entropy losses and loss aggregation: pure tensor functions.

Shapes: B sequences, T response tokens; `mask_BR` is 1 on response tokens. Semantics follow PPO
(Schulman et al. 2017), dual-clip PPO (Ye et al. 2020), DAPO's clip-higher and token-mean (Yu et al. 2025)
and verl's `core_algos.py`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .masked import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def agg_loss(loss_BR: torch.Tensor, mask_BR: torch.Tensor, mode: str,
             num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    token-mean:          sum of all token losses / number of tokens   (DAPO)
    seq-mean-token-sum:  mean over sequences of each sequence's token sum (Dr. GRPO-style)
    seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO)

    `num_tokens` / `num_seqs` replace the local counts as denominators. Passing the counts of a whole
    mini-batch makes the losses of its micro-batches (or data-parallel shards) add up exactly to the
    loss of the mini-batch.
    """
    mask = mask_BR.to(loss_BR.dtype)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return (loss_BR * mask).sum() / _positive(denom, loss_BR)
    if mode == "seq-mean-token-sum":
        per_seq = (loss_BR * mask).sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = (loss_BR * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    else:
        raise ValueError(f"unknown loss aggregation '{mode}'; use one of {LOSS_AGG_MODES}")
    denom = loss_BR.shape[0] if num_seqs is None else num_seqs
    return per_seq.sum() / _positive(denom, loss_BR)


def _positive(denom, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(denom, dtype=like.dtype).clamp(min=1e-8)


def ppo_policy_loss(logprobs_BR: torch.Tensor, old_logprobs_BR: torch.Tensor, advantages_BR: torch.Tensor,
                    mask_BR: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip: float | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token clipped surrogate loss: max(-A r, -A clip(r, 1-clip_low, 1+clip_high)).

    With `dual_clip=c` (c > 1), losses of tokens with A < 0 are further capped at -A c (Ye et al. 2020).
    Returns (loss_BR, stats) with stats clip_frac, clip_frac_lower (dual clip), approx_kl (k1 of old||new)
    and log_ratio_abs (mean |log r|: approx_kl's terms can cancel, these cannot).
    """
    log_ratio = (logprobs_BR - old_logprobs_BR).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages_BR * ratio
    loss2 = -advantages_BR * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    stats = {
        "clip_frac": masked_mean((loss2 > loss1).float(), mask_BR).item(),
        "approx_kl": masked_mean(-log_ratio, mask_BR).item(),
        "log_ratio_abs": masked_mean(log_ratio.abs(), mask_BR).item(),  # 0 only where every token's ratio is 1
    }
    if dual_clip is not None:
        loss3 = -advantages_BR * dual_clip
        capped = torch.minimum(clipped, loss3)
        stats["clip_frac_lower"] = masked_mean(((clipped > loss3) & (advantages_BR < 0)).float(), mask_BR).item()
        clipped = torch.where(advantages_BR < 0, capped, clipped)
    return clipped, stats


def value_loss(values_BR: torch.Tensor, old_values_BR: torch.Tensor, returns_BR: torch.Tensor,
               mask_BR: torch.Tensor, clip: float) -> tuple[torch.Tensor, dict]:
    """Per-token clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old ± clip) - R)^2) (PPO2, verl)."""
    clipped_values = old_values_BR + (values_BR - old_values_BR).clamp(-clip, clip)
    l1 = (values_BR - returns_BR) ** 2
    l2 = (clipped_values - returns_BR) ** 2
    return 0.5 * torch.maximum(l1, l2), {"vf_clip_frac": masked_mean((l2 > l1).float(), mask_BR).item()}


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: logsumexp(z) - sum softmax(z) * z."""
    logits = logits_BTV.float()
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


# ---- registry: the per-token policy loss the policy worker uses (algo.policy_loss) ---------------
# fn(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg) -> loss_BR, or (loss_BR, {stat: float});
# `cfg` is the AlgoConfig. The worker aggregates loss_BR with algo.loss_agg. `@sess.policy_loss` adds yours.
PolicyLossFn = Callable[..., "torch.Tensor | tuple[torch.Tensor, dict]"]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def _ppo(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg):
    return ppo_policy_loss(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, cfg.clip_low, cfg.clip_high,
                           cfg.dual_clip)


POLICY_LOSSES["ppo"] = _ppo


def policy_loss(name: str, logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, cfg) -> tuple[torch.Tensor, dict]:
    """(loss_BR, stats) with the loss registered under `name`."""
    out = POLICY_LOSSES[name](logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, cfg=cfg)
    return out if isinstance(out, tuple) else (out, {})
