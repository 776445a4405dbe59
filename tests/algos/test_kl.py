"""KL estimators, the KL reward penalty and the KL coefficient controllers (rlbench_nb/algos/kl.py)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from rlbench_nb.algos import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty, make_kl_controller


# ---------------------------------------------------------------- estimators
def test_kl_estimators_hand_worked():
    ref = torch.tensor([-1.0, -1.0, -1.0])
    lp = ref + torch.tensor([1.0, -2.0, 0.0])  # lp - ref = [1, -2, 0]; log r = ref - lp = [-1, 2, 0]
    # k1 = lp - ref
    assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([1.0, -2.0, 0.0]))
    # k2 = 0.5 (lp - ref)^2 = [0.5, 2, 0]
    assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5, 2.0, 0.0]))
    # k3 = exp(log r) - log r - 1: e^-1 + 1 - 1 = 0.367879; e^2 - 2 - 1 = 4.389056; 1 - 0 - 1 = 0
    assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([0.367879, 4.389056, 0.0]), atol=1e-5, rtol=1e-5)


def test_k3_default_nonnegative_and_matches_formula_random():
    g = torch.Generator().manual_seed(20)
    lp = torch.randn(4, 9, generator=g) * 0.5 - 3  # moderate gaps: stay inside the [-10, 10] safety clamp
    ref = torch.randn(4, 9, generator=g) * 0.5 - 3
    k3 = kl_penalty(lp, ref)  # k3 is the default
    ref_k3 = [[math.exp(b - a) - (b - a) - 1 for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    assert_close(k3, torch.tensor(ref_k3), atol=1e-5, rtol=1e-5)
    assert (k3 >= 0).all()
    # k1 can be negative on single samples
    assert (kl_penalty(lp, ref, "k1") < 0).any()


def test_k3_is_clamped_for_numerical_safety():
    # lp - ref = -30: log r clamps to 20, exp(20) - 21 is huge -> clamped to 10
    out = kl_penalty(torch.tensor([-40.0]), torch.tensor([-10.0]), "k3")
    assert torch.isfinite(out).all()
    assert_close(out, torch.tensor([10.0]))


def test_k1_and_k3_are_unbiased_in_expectation():
    # Weighting by pi (the sampling distribution) gives the expectation exactly:
    # E_pi[k1] = E_pi[k3] = KL(pi || ref) = sum pi log(pi / ref). k2 is biased (not equal in general).
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.2, 0.6])
    kl = (pi * (pi / ref).log()).sum()
    for est in ("k1", "k3"):
        assert_close((pi * kl_penalty(pi.log(), ref.log(), est)).sum(), kl)
    assert not torch.allclose((pi * kl_penalty(pi.log(), ref.log(), "k2")).sum(), kl)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# ---------------------------------------------------------------- KL in the reward
def test_apply_kl_penalty_hand_worked():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref = torch.zeros(2, 3)
    lp = torch.tensor([[1.0, -2.0, 0.0], [0.5, 0.5, 3.0]])  # k1 = lp - ref
    out, current = apply_kl_penalty(rewards, lp, ref, mask, coef=0.1, estimator="k1")
    # masked kl [[1, -2, 0], [.5, .5, 0]]; r - 0.1 kl -> [[-0.1, 0.2, 1], [-0.05, 1.95, 0.5 (padding untouched)]]
    assert_close(out, torch.tensor([[-0.1, 0.2, 1.0], [-0.05, 1.95, 0.5]]))
    # mean over sequences of per-sequence token means: (-1/3 + 0.5) / 2 = 0.083333
    assert current == pytest.approx((-1 / 3 + 0.5) / 2)


def test_apply_kl_penalty_k3_matches_reference_random():
    g = torch.Generator().manual_seed(21)
    B, T = 3, 5
    rewards = torch.randn(B, T, generator=g)
    lp, ref = torch.randn(B, T, generator=g) - 2, torch.randn(B, T, generator=g) - 2
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in (5, 2, 4)])
    out, current = apply_kl_penalty(rewards, lp, ref, mask, coef=0.3, estimator="k3")
    per_seq, exp_out = [], rewards.clone()
    for b in range(B):
        ks = []
        for t in range(T):
            if mask[b, t] > 0:
                d = ref[b, t].item() - lp[b, t].item()
                k = math.exp(d) - d - 1
                exp_out[b, t] -= 0.3 * k
                ks.append(k)
        per_seq.append(sum(ks) / len(ks))
    assert_close(out, exp_out, atol=1e-5, rtol=1e-5)
    assert current == pytest.approx(sum(per_seq) / B, rel=1e-5)


# ---------------------------------------------------------------- controllers
def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(current_kl=10.0, n_steps=1000)
    assert c.value == 0.05
    d = FixedKLController(1.0)
    d.load_state_dict(c.state_dict())
    assert d.value == 0.05


@pytest.mark.parametrize("kl,expected", [
    (0.11, 0.2 * 1.01),  # kl/target - 1 = +0.1 -> value *= 1 + 0.1 * 10/100 = 1.01 -> 0.202
    (0.09, 0.2 * 0.99),  # -0.1 -> value *= 0.99 -> 0.198
    (1.0, 0.2 * 1.02),   # +9 clipped to +0.2 -> value *= 1 + 0.2 * 0.1 = 1.02 -> 0.204
    (0.0, 0.2 * 0.98),   # -1 clipped to -0.2 -> value *= 0.98 -> 0.196
    (0.1, 0.2),          # on target -> unchanged
])
def test_adaptive_controller_hand_worked(kl, expected):
    c = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    c.update(current_kl=kl, n_steps=10)
    assert c.value == pytest.approx(expected)


def test_adaptive_controller_compounds_and_state_dict_round_trip():
    c = AdaptiveKLController(0.2, 0.1, 100)
    c.update(0.11, 10)  # 0.2 * 1.01
    c.update(0.5, 50)   # error clipped to 0.2 -> * (1 + 0.2 * 0.5) = 1.1
    assert c.value == pytest.approx(0.2 * 1.01 * 1.1)
    d = AdaptiveKLController(0.2, 0.1, 100)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value
    c.update(0.05, 20)  # -0.5 clipped to -0.2 -> * (1 - 0.2 * 0.2) = 0.96
    d.update(0.05, 20)
    assert d.value == c.value == pytest.approx(0.2 * 1.01 * 1.1 * 0.96)


def test_make_kl_controller():
    cfg = SimpleNamespace(kl_ctrl="adaptive", kl_coef=0.3, target_kl=0.2, kl_horizon=50)
    c = make_kl_controller(cfg)
    assert isinstance(c, AdaptiveKLController)
    assert (c.value, c.target, c.horizon) == (0.3, 0.2, 50)
    f = make_kl_controller(SimpleNamespace(kl_ctrl="fixed", kl_coef=0.3, target_kl=0.2, kl_horizon=50))
    assert type(f) is FixedKLController and f.value == 0.3
