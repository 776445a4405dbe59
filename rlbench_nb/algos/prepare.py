"""prepare()'s math as one function of tensors: from a scored batch and the roles' forward passes to the
token rewards, importance weights, KL and advantages an update trains on. No workers, no I/O: the
session collects the forward passes (session.py, `Session.prepare`) and calls this.

    out = advantages_for(batch, forwards, cfg.algo, uses_reference=True, kl_coef=0.001)
    out.tensors["advantages_BR"], out.metrics["kl/ref"]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UsageError
from .advantages import compute_advantages, outcome_token_rewards, sequence_advantage
from .kl import reference_kl
from .masked import masked_mean
from .mismatch import mismatch_metrics, rollout_is_weights


@dataclass
class Prepared:
    """What prepare adds to a batch: tensors (`token_rewards_BR`, `advantages_BR`, and `returns_BR`,
    `is_weights_BR` where they apply), `advantage` (one float per sample, for the inspector), `kl_current`
    (the measured KL the KL controller moves by when the step is taken; None when not measured here) and
    the metrics (`mismatch/*`, `is/*`, `kl/ref`, `kl/coef`)."""
    tensors: dict[str, torch.Tensor]
    advantage: list[float]
    kl_current: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def advantages_for(batch, forwards, algo, *, uses_reference: bool, kl_coef: float) -> Prepared:
    """`batch`: scored (`scores_B`, `response_mask_BR`, `group`; `rollout_logprobs_BR` from the engine,
    `loss_mask_BR` for episodes). `forwards`: what the roles' passes gave (`old_logprobs_BR` unless the
    update's own forward measures them, `ref_logprobs_BR` with a reference, `values_BR` with a critic).
    `algo`: the AlgoConfig; `kl_coef`: the KL controller's value now."""
    if "loss_mask_BR" in batch and algo.advantage not in ("grpo", "rloo"):  # what the config refuses with env.fn,
        # reached by replaying saved episodes: returns and whitening would run across the environment's tokens
        raise UsageError(f"these are multi-turn episodes (environment tokens between the model's turns), and "
                         f"algo.advantage={algo.advantage} computes per-token returns across them, which is not "
                         "supported yet: prepare them with grpo or rloo")
    mask = batch["response_mask_BR"].float()  # where each sequence is: its reward sits on the last token
    trained = (batch["loss_mask_BR"] if "loss_mask_BR" in batch else batch["response_mask_BR"]).float()
    out, m, kl_current = {}, {}, None
    old = forwards.get("old_logprobs_BR")
    if old is not None and "rollout_logprobs_BR" in batch and not batch.info.get("off_policy"):
        # the engine's sampler vs the trainer on the same tokens and weights (reused: the policy worker
        # measures it in its update, from the same forward)
        m.update(mismatch_metrics(batch["rollout_logprobs_BR"], old, trained))
        if algo.rollout_is != "off":
            out["is_weights_BR"], is_stats = rollout_is_weights(old, batch["rollout_logprobs_BR"], trained,
                                                                algo.rollout_is, algo.rollout_is_cap)
            m.update(is_stats)
    rewards = outcome_token_rewards(batch["scores_B"], mask)
    if uses_reference:
        m["kl/coef"] = kl_coef
    if uses_reference and old is not None:  # reused: the update measures the KL itself
        kl_BR, kl_current = reference_kl(old, forwards["ref_logprobs_BR"], trained, algo.kl_estimator)
        m["kl/ref"] = masked_mean(kl_BR, trained).item()
        if algo.kl_in == "reward":
            rewards = rewards - kl_coef * kl_BR
    adv, returns = compute_advantages(algo.advantage, rewards, mask, group_ids=batch["group"],
                                      values_BR=forwards.get("values_BR"), cfg=algo)
    adv = adv * trained if "loss_mask_BR" in batch else adv  # no advantage on environment tokens
    out["token_rewards_BR"], out["advantages_BR"] = rewards, adv
    if returns is not None:
        out["returns_BR"] = returns
    return Prepared(out, sequence_advantage(adv, trained).tolist(), kl_current, m)
