"""The Tinker API's built-in losses, pinned against values worked by hand. Each is a sum of per-token terms (no
mean), so the numbers below are exact sums of exp/log of round values: float32 on any CPU agrees to 1e-6."""
import math

import pytest
import torch

from rlbench_nb.algos.tinker_losses import LossInputError, loss_config, tinker_loss

LOGP = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])     # the trainer's log-probs of 3 targets
MASK = torch.tensor([[1.0, 1.0, 0.0]])                           # the third position is padding
# the sampler's log-probs: ratios 2.0 and 0.5 at the two real positions
INPUTS = {"weights": torch.tensor([[1.0, 2.0, 5.0]]), "advantages": torch.tensor([[1.0, -1.0, 9.0]]),
          "logprobs": torch.tensor([[math.log(0.25), math.log(0.5), 0.0]])}


def total(name, **cfg):
    return float(tinker_loss(name, LOGP, INPUTS, MASK, loss_config(name, cfg)).sum())


def test_cross_entropy_is_the_weighted_negative_log_likelihood_summed():
    assert total("cross_entropy") == pytest.approx(-(1 * math.log(0.5) + 2 * math.log(0.25)), abs=1e-6)


def test_importance_sampling_weights_each_advantage_by_its_ratio():
    # -(2.0 * 1) - (0.5 * -1) = -1.5
    assert total("importance_sampling") == pytest.approx(-1.5, abs=1e-6)


def test_ppo_takes_the_pessimistic_of_the_clipped_and_unclipped_terms():
    # A=+1, r=2 -> min(2, 1.2) = 1.2; A=-1, r=0.5 -> min(-0.5, -0.8) = -0.8: loss -(1.2 - 0.8) = -0.4
    assert total("ppo") == pytest.approx(-0.4, abs=1e-6)
    assert total("ppo", clip_low_threshold=0.4, clip_high_threshold=3.0) == pytest.approx(-(2.0 - 0.5), abs=1e-6)


def test_cispo_weights_the_log_prob_by_the_clipped_ratio_without_its_gradient():
    # -(1.2 * log .5 * 1) - (0.8 * log .25 * -1)
    assert total("cispo") == pytest.approx(-(1.2 * math.log(0.5) - 0.8 * math.log(0.25)), abs=1e-6)
    logp = LOGP.clone().requires_grad_()
    tinker_loss("cispo", logp, INPUTS, MASK, loss_config("cispo", {})).sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.2, 0.8, 0.0], abs=1e-6)  # d/dlogp: -clip(r)*A, r held fixed


def test_dro_penalises_the_squared_log_ratio():
    beta, d = 0.1, math.log(2.0)  # log ratio +log2 and -log2 at the two positions
    want = -((math.log(0.5) * 1 - 0.5 * beta * d * d) + (math.log(0.25) * -1 - 0.5 * beta * d * d))
    assert total("dro", beta=beta) == pytest.approx(want, abs=1e-6)


def test_an_unknown_loss_or_config_key_is_refused_by_name():
    with pytest.raises(LossInputError, match="'gspo' is not one this server computes"):
        loss_config("gspo", {})
    with pytest.raises(LossInputError, match=r"\['clip_ratio'\] are not ppo's"):
        loss_config("ppo", {"clip_ratio": 0.2})
