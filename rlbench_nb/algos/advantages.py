"""Advantage estimators: pure tensor functions (no Ray, no I/O).

Shapes: B sequences, R response tokens. `rewards_BR` holds token-level rewards (the verifier's score
sits on the last response token; a KL penalty, if applied in the reward, on every token); `mask_BR`
is 1 on response tokens. Semantics follow the papers and verl's `core_algos.py`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .masked import masked_whiten


def outcome_token_rewards(scores_B: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """Token-level rewards of an outcome score: each sequence's score on its last response token, zero
    elsewhere (an empty response keeps it on position 0), in fp32."""
    last_B = (mask_BR.sum(-1) - 1).clamp(min=0).long()
    rewards_BR = torch.zeros(mask_BR.shape, dtype=torch.float32)
    rewards_BR[torch.arange(len(scores_B)), last_B] = scores_B.float()
    return rewards_BR


def sequence_advantage(advantages_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """One number per sample for tables and files: the mean advantage over its response tokens."""
    mask = mask_BR.float()
    return (advantages_BR * mask).sum(-1) / mask.sum(-1).clamp(min=1)


class _Groups:
    """Arbitrary hashable group ids as indices 0..G-1, with each group's size and first sample. The group
    statistics are numpy float64 on a few values a group: a torch op costs ~5-10 µs of dispatch, ~40 of them
    were ~0.6 ms of the controller's busy step (benchmarks/README.md), and float64 sums round less."""

    def __init__(self, group_ids: Sequence):
        table: dict = {}  # id -> its index, numbered in order of first appearance
        self.index = np.array([table.setdefault(g, len(table)) for g in group_ids], dtype=np.intp)
        self.first = np.unique(self.index, return_index=True)[1]
        self.count = np.bincount(self.index, minlength=len(table))

    def total(self, values_B: np.ndarray) -> np.ndarray:
        """Each group's sum of `values_B` (float64), one per group."""
        return np.bincount(self.index, weights=values_B, minlength=len(self.first))

    def shifted(self, scores_B: np.ndarray) -> np.ndarray:
        """Each score minus its group's first one: exactly 0 across a group of equal scores, where a plain
        sum / n can round (in fp32, before these sums were float64, eight scores of 0.2 summed to 1.6000001, so
        r - mean was 1.5e-8 and, over an std as small, GRPO gave the tie an advantage of 0.015 instead of 0;
        float64 sums of float64 scores round too)."""
        return scores_B - scores_B[self.first][self.index]


def _float64(scores_B: torch.Tensor) -> np.ndarray:
    """The scores as a float64 array (every fp32 or bf16 value exactly)."""
    return scores_B.detach().cpu().double().numpy()


def tied_share(scores_B: torch.Tensor, group_ids: Sequence) -> float:
    """The share of groups whose scores are all equal (TRL's frac_reward_zero_std): the ones GRPO and RLOO give
    an advantage of exactly 0, by the same test (every score equal to the group's first)."""
    groups = _Groups(group_ids)
    differs = groups.total(groups.shifted(_float64(scores_B)) != 0)
    return float((differs == 0).mean()) if len(groups.first) else 0.0


def grpo_advantages(scores_B: torch.Tensor, group_ids: Sequence, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath): (r - mean_group) / (std_group + eps), fp32.

    The std is the unbiased one (as torch.std), as in verl. A group of one sample gets mean 0 and std 1.
    A group whose scores are all equal gets exactly 0. With `norm_by_std=False` this is Dr. GRPO (Liu et
    al. 2025): r - mean_group. All groups at once: a loop over groups cost ~0.5 ms a step.
    """
    groups = _Groups(group_ids)
    scores = _float64(scores_B)
    shifted = groups.shifted(scores)
    centered = shifted - (groups.total(shifted) / groups.count)[groups.index]
    if norm_by_std:
        std = np.sqrt(groups.total(centered * centered) / np.maximum(groups.count - 1, 1))
        centered = centered / (std[groups.index] + eps)
    alone = groups.count[groups.index] == 1
    return torch.from_numpy(np.where(alone, scores / (1 + eps) if norm_by_std else scores, centered)
                            .astype(np.float32))


def rloo_advantages(scores_B: torch.Tensor, group_ids: Sequence) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean of the other samples of its prompt,
    i.e. n/(n-1) * (r_i - mean_group), fp32. A group of one sample keeps its raw score; a group of equal
    scores gets exactly 0."""
    groups = _Groups(group_ids)
    scores = _float64(scores_B)
    shifted = groups.shifted(scores)
    n = groups.count[groups.index]
    adv = (shifted * n - groups.total(shifted)[groups.index]) / np.maximum(n - 1, 1)
    return torch.from_numpy(np.where(n == 1, scores, adv).astype(np.float32))


def discounted_returns(rewards_BR: torch.Tensor, mask_BR: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, restarted after the last valid token of each row."""
    returns = torch.zeros_like(rewards_BR, dtype=torch.float32)
    running = torch.zeros(rewards_BR.shape[0])
    for t in reversed(range(rewards_BR.shape[1])):
        running = rewards_BR[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask_BR[:, t]
    return returns


def reinforce_pp_advantages(rewards_BR: torch.Tensor, mask_BR: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted token returns, whitened across the whole batch."""
    returns = discounted_returns(rewards_BR, mask_BR, gamma)
    return masked_whiten(returns, mask_BR) * mask_BR


def gae_advantages(rewards_BR: torch.Tensor, values_BR: torch.Tensor, mask_BR: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016). Returns (advantages_BR whitened over the batch, returns_BR = A + V).

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1}; padding tokens carry
    the next valid value and advantage through, as in verl.
    """
    B, R = rewards_BR.shape
    next_value = torch.zeros(B)
    last_gae = torch.zeros(B)
    adv_rev = []
    for t in reversed(range(R)):
        m = mask_BR[:, t].float()
        delta = rewards_BR[:, t] + gamma * next_value - values_BR[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values_BR[:, t] * m + (1 - m) * next_value
        last_gae = gae_t * m + (1 - m) * last_gae
        adv_rev.append(last_gae)
    advantages = torch.stack(adv_rev[::-1], dim=1)
    returns = advantages + values_BR
    return masked_whiten(advantages, mask_BR) * mask_BR, returns


# ---- registry: one calling convention for the controller ---------------------------------------
# An estimator: fn(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg) -> (advantages_BR, returns_BR or
# None); `cfg` is the AlgoConfig. Registered by name; `algo.advantage` names one (`@sess.advantage` adds yours).
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
ADVANTAGES: dict[str, AdvantageFn] = {}
NEEDS_VALUES: set[str] = set()  # estimators that read the critic's values: algo.advantage=<one> starts a critic


def register(name: str, needs_values: bool = False):
    def deco(fn):
        ADVANTAGES[name] = fn
        if needs_values:
            NEEDS_VALUES.add(name)
        return fn
    return deco


@register("grpo")
def _grpo(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg):
    adv_B = grpo_advantages(rewards_BR.sum(-1), group_ids, norm_by_std=cfg.norm_adv_by_std)
    return adv_B[:, None] * mask_BR, None


@register("rloo")
def _rloo(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg):
    return rloo_advantages(rewards_BR.sum(-1), group_ids)[:, None] * mask_BR, None


@register("reinforce_pp")
def _reinforce_pp(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg):
    return reinforce_pp_advantages(rewards_BR, mask_BR, cfg.gamma), None


@register("gae", needs_values=True)
def _gae(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg):
    if values_BR is None:
        raise ValueError("algo.advantage=gae needs critic values; the critic role did not run")
    return gae_advantages(rewards_BR, values_BR, mask_BR, cfg.gamma, cfg.lam)


def compute_advantages(name: str, rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg):
    """(advantages_BR, returns_BR or None) with the estimator registered under `name`."""
    if name not in ADVANTAGES:
        raise KeyError(f"unknown advantage estimator '{name}'; known: {sorted(ADVANTAGES)}")
    return ADVANTAGES[name](rewards_BR.float(), mask_BR.float(), group_ids=group_ids, values_BR=values_BR, cfg=cfg)
