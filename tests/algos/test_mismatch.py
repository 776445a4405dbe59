"""Mismatch metrics and rollout corrections against hand-computed values."""
import math

import pytest
import torch

from rlbench_nb.algos import mismatch_metrics, rollout_is_weights

MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # three response tokens; the last one is padding


def test_mismatch_metrics_by_hand():
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    trainer = torch.tensor([[-1.1, -2.0], [-0.5, 0.3]])  # padding differs: it must not count
    m = mismatch_metrics(rollout, trainer, MASK)
    d = -0.1  # the one token that differs (float32 inputs: 1e-6 relative)
    assert m["mismatch/logp_abs_mean"] == pytest.approx(0.1 / 3, rel=1e-5)
    assert m["mismatch/logp_abs_max"] == pytest.approx(0.1, rel=1e-5)
    assert m["mismatch/prob_ratio_err"] == pytest.approx((abs(math.exp(d / 2) - 1) + 0) / 2, rel=1e-4)
    assert m["mismatch/kl_k3"] == pytest.approx((math.exp(d) - 1 - d) / 3, rel=1e-3)
    exact = mismatch_metrics(rollout, rollout, MASK)
    assert exact == {k: 0.0 for k in m}


def test_truncated_and_masked_importance_weights_by_hand():
    rollout = torch.zeros(2, 2)
    # p/q = 3, 1 | 0.6, (padding); the trainer's log-probs carry a gradient, the weights must not
    trainer = torch.tensor([[math.log(3.0), 0.0], [math.log(0.6), 5.0]], requires_grad=True)
    w, stats = rollout_is_weights(trainer, rollout, MASK, "tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0], [0.6, 0.0]]))  # min(p/q, 2) on real tokens
    assert stats["mismatch/is_capped_frac"] == pytest.approx(1 / 3)
    assert stats["mismatch/is_weight_mean"] == pytest.approx((2 + 1 + 0.6) / 3)
    w, stats = rollout_is_weights(trainer, rollout, MASK, "mis", cap=2.0)
    # sequence ratios: 3 (outside [1/2, 2]: masked) and 0.6 (inside: kept)
    assert torch.equal(w, torch.tensor([[0.0, 0.0], [1.0, 0.0]]))
    assert stats["mismatch/is_masked_frac"] == 0.5
    w, stats = rollout_is_weights(trainer, rollout, MASK, "off", cap=2.0)
    assert torch.equal(w, torch.ones(2, 2)) and stats == {}
    w, _ = rollout_is_weights(trainer, rollout, MASK, "tis", cap=2.0)
    assert not w.requires_grad and w.grad_fn is None
