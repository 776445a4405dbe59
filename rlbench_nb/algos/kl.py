"""KL estimators and KL coefficient controllers: pure functions and tiny state.

Estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL divergence"):
with log r = log pi_ref(x) - log pi(x),
    k1 = -log r              unbiased, high variance, can be negative
    k2 = 0.5 (log r)^2       biased, low variance
    k3 = (r - 1) - log r     unbiased, low variance, always >= 0 ("low_var_kl" in verl; GRPO's choice)
"""
from __future__ import annotations

import torch

from .masked import masked_mean

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logprobs_BR: torch.Tensor, ref_logprobs_BR: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate; k3 is clamped to [-10, 10] as in verl for numerical safety."""
    diff = logprobs_BR - ref_logprobs_BR
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        log_r = (-diff).clamp(-20.0, 20.0)
        return (torch.exp(log_r) - log_r - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator '{estimator}'; use one of {KL_ESTIMATORS}")


def reference_kl(logprobs_BR: torch.Tensor, ref_logprobs_BR: torch.Tensor, mask_BR: torch.Tensor,
                 estimator: str = "k3") -> tuple[torch.Tensor, float]:
    """(per-token KL estimate, zero on padding; its mean per sequence, averaged over the batch). The second
    is what a KL controller tracks (Ziegler et al. 2019 average the sequences' KL)."""
    kl = kl_penalty(logprobs_BR, ref_logprobs_BR, estimator) * mask_BR
    return kl, masked_mean(kl, mask_BR, dim=-1).mean().item()


def apply_kl_penalty(rewards_BR: torch.Tensor, logprobs_BR: torch.Tensor, ref_logprobs_BR: torch.Tensor,
                     mask_BR: torch.Tensor, coef: float, estimator: str) -> tuple[torch.Tensor, float]:
    """KL as a reward penalty: r_t - coef * kl_t on response tokens. Returns (rewards_BR, mean per-seq KL)."""
    kl, current_kl = reference_kl(logprobs_BR, ref_logprobs_BR, mask_BR, estimator)
    return rewards_BR - coef * kl, current_kl


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Adaptive coefficient (Ziegler et al. 2019): value *= 1 + clip(kl/target - 1, ±0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        super().__init__(init_kl_coef)
        self.target, self.horizon = target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def make_kl_controller(algo_cfg):
    if algo_cfg.kl_ctrl == "adaptive":
        return AdaptiveKLController(algo_cfg.kl_coef, algo_cfg.target_kl, algo_cfg.kl_horizon)
    return FixedKLController(algo_cfg.kl_coef)
