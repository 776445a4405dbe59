"""The Tinker API's built-in losses (`forward_backward(data, loss_fn=...)`): pure tensor functions.

Each takes the trainer's log-probs of the target tokens (`target_logprobs_BT`, with gradient) and the datum's
`loss_fn_inputs` as [B, T] tensors (`target_tokens`, `weights`, `logprobs` = the sampler's, `advantages`,
zero-padded past each datum's length) and returns the per-token loss. Tinker's losses are **sums** over tokens and
data, not means: `loss:sum` is `elementwise.sum()` and the gradient is that sum's. The formulas are those Tinker's
documentation gives (tinker-docs.thinkingmachines.ai/tinker/losses), with ratio = exp(target - sampling log-probs):

    cross_entropy        -weights * logp
    importance_sampling  -ratio * A
    ppo                  -min(ratio * A, clip(ratio, low, high) * A)          low, high: 0.8, 1.2 by default
    cispo                -sg(clip(ratio, low, high)) * logp * A               low, high: 0.8, 1.2 by default
    dro                  -(logp * A - beta / 2 * (logp - sampling logp)^2)    beta: 0.05 by default
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# loss name -> (the loss_fn_inputs it reads besides target_tokens, its loss_fn_config keys with their defaults)
TINKER_LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "dro": (("logprobs", "advantages"), {"beta": 0.05}),
}


class LossInputError(ValueError):
    """A forward_backward request whose loss, inputs or config do not fit each other: the message names which."""


def loss_config(name: str, given: dict | None) -> dict[str, float]:
    """`given` (the request's loss_fn_config) over the loss's defaults; an unknown loss or key is a LossInputError."""
    if name not in TINKER_LOSSES:
        raise LossInputError(f"loss_fn '{name}' is not one this server computes: use one of {sorted(TINKER_LOSSES)} "
                             "or forward_backward_custom")
    defaults = TINKER_LOSSES[name][1]
    unknown = sorted(set(given or {}) - set(defaults))
    if unknown:
        raise LossInputError(f"loss_fn_config keys {unknown} are not {name}'s: it takes {sorted(defaults) or 'none'}")
    return {**defaults, **{k: float(v) for k, v in (given or {}).items()}}


def _ratio(logp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def cross_entropy(logp, inputs, cfg):
    return -inputs["weights"] * logp


def importance_sampling(logp, inputs, cfg):
    return -_ratio(logp, inputs) * inputs["advantages"]


def ppo(logp, inputs, cfg):
    ratio, adv = _ratio(logp, inputs), inputs["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo(logp, inputs, cfg):
    clipped = _ratio(logp, inputs).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -clipped * logp * inputs["advantages"]


def dro(logp, inputs, cfg):
    return -(logp * inputs["advantages"] - 0.5 * cfg["beta"] * (logp - inputs["logprobs"]) ** 2)


LOSS_FNS: dict[str, Callable[[torch.Tensor, dict, dict], torch.Tensor]] = {
    "cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo, "dro": dro}


def tinker_loss(name: str, target_logprobs_BT: torch.Tensor, inputs: dict[str, torch.Tensor], mask_BT: torch.Tensor,
                cfg: dict[str, float]) -> torch.Tensor:
    """Per-token loss [B, T] of `name`, zero outside `mask_BT` (padding): its sum is the request's loss."""
    return LOSS_FNS[name](target_logprobs_BT, inputs, cfg) * mask_BT
