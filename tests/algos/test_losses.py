"""Losses (rlbench_nb/algos/losses.py): PPO clipped surrogate with asymmetric (DAPO clip-higher) and
dual clip, loss aggregation, clipped value loss, entropy. Hand-worked numbers plus loop references."""
from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlbench_nb.algos import agg_loss, entropy_from_logits, ppo_policy_loss, value_loss
from rlbench_nb.algos.losses import LOSS_AGG_MODES


def _logp_pair(ratios):
    """(logprobs, old_logprobs) with exp(logprobs - old) == ratios."""
    old = torch.full_like(ratios, -1.0)
    return old + torch.log(ratios), old


# ---------------------------------------------------------------- PPO policy loss
RATIOS = torch.tensor([[1.5, 1.25, 0.7, 0.85], [1.5, 0.5, 1.0, 3.0]])
ADVS = torch.tensor([[1.0, 1.0, -1.0, -1.0], [-1.0, 1.0, 2.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])  # last token is padding


def test_ppo_policy_loss_asymmetric_clip_hand_worked():
    lp, old = _logp_pair(RATIOS)
    loss, stats = ppo_policy_loss(lp, old, ADVS, MASK, clip_low=0.2, clip_high=0.28)
    # per token max(-A r, -A clip(r, 0.8, 1.28)):
    #  A=+1 r=1.5  : max(-1.5, -1.28) = -1.28   clipped at 1 + clip_high (not 1.2)
    #  A=+1 r=1.25 : max(-1.25, -1.25) = -1.25  inside [0.8, 1.28]; a symmetric 0.2 clip would give -1.2
    #  A=-1 r=0.7  : max(0.7, 0.8) = 0.8        clipped at 1 - clip_low
    #  A=-1 r=0.85 : 0.85                       inside
    #  A=-1 r=1.5  : max(1.5, 1.28) = 1.5       pessimistic: the unclipped loss wins, not clipped
    #  A=+1 r=0.5  : max(-0.5, -0.8) = -0.5     not clipped
    #  A=+2 r=1.0  : -2
    #  padding A=+1 r=3: -1.28 (clipped, but must not count in clip_frac)
    expected = torch.tensor([[-1.28, -1.25, 0.8, 0.85], [1.5, -0.5, -2.0, -1.28]])
    assert_close(loss, expected)
    assert stats["clip_frac"] == pytest.approx(2 / 7)  # tokens (0,0) and (0,2) of 7 valid
    # approx_kl = masked mean of -(lp - old) = -mean(log r) over the 7 valid tokens
    logs = [math.log(r) for r in (1.5, 1.25, 0.7, 0.85, 1.5, 0.5, 1.0)]
    assert stats["approx_kl"] == pytest.approx(-sum(logs) / 7, rel=1e-5)
    assert "clip_frac_lower" not in stats


def test_ppo_policy_loss_symmetric_clip_differs():
    lp, old = _logp_pair(RATIOS)
    loss, stats = ppo_policy_loss(lp, old, ADVS, MASK, clip_low=0.2, clip_high=0.2)
    # same tokens with [0.8, 1.2]: A=+1 r=1.5 -> -1.2, A=+1 r=1.25 -> -1.2 (now clipped), A=-1 r=1.5 -> 1.5
    expected = torch.tensor([[-1.2, -1.2, 0.8, 0.85], [1.5, -0.5, -2.0, -1.2]])
    assert_close(loss, expected)
    assert stats["clip_frac"] == pytest.approx(3 / 7)


def test_ppo_policy_loss_dual_clip_hand_worked():
    ratios = torch.tensor([[5.0, 2.0, 5.0, 4.0]])
    advs = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    mask = torch.ones(1, 4)
    lp, old = _logp_pair(ratios)
    loss, stats = ppo_policy_loss(lp, old, advs, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    #  A=-1 r=5 : clipped loss max(5, 1.28) = 5  -> capped at -A*c = 3
    #  A=-1 r=2 : max(2, 1.28) = 2 < 3           -> unchanged 2
    #  A=+1 r=5 : max(-5, -1.28) = -1.28; -A*c = -3 would be smaller, but A > 0 is never capped -> -1.28
    #  A=-2 r=4 : max(8, 2.56) = 8               -> capped at 2*3 = 6
    assert_close(loss, torch.tensor([[3.0, 2.0, -1.28, 6.0]]))
    assert stats["clip_frac_lower"] == pytest.approx(2 / 4)
    assert stats["clip_frac"] == pytest.approx(1 / 4)  # only the A=+1 r=5 token hits the ordinary clip
    # without dual clip the negative-advantage losses are unbounded
    loss_nodual, _ = ppo_policy_loss(lp, old, advs, mask, clip_low=0.2, clip_high=0.28)
    assert_close(loss_nodual, torch.tensor([[5.0, 2.0, -1.28, 8.0]]))


def _ref_ppo_token(r, a, lo, hi, c):
    """-min(r A, clip(r) A), then for A < 0 capped at -c A (dual-clip PPO)."""
    clipped_r = min(max(r, 1 - lo), 1 + hi)
    loss = -min(r * a, clipped_r * a)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss


@pytest.mark.parametrize("lo,hi,c", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_ppo_policy_loss_matches_reference_random(lo, hi, c):
    g = torch.Generator().manual_seed(10)
    B, T = 4, 6
    lp = torch.randn(B, T, generator=g) * 0.5 - 1
    old = lp + torch.randn(B, T, generator=g) * 0.6
    adv = torch.randn(B, T, generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in (6, 4, 1, 5)])
    loss, stats = ppo_policy_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi, dual_clip=c)
    ratios = torch.exp(lp - old).tolist()
    ref = torch.tensor([[_ref_ppo_token(ratios[b][t], adv[b, t].item(), lo, hi, c) for t in range(T)]
                        for b in range(B)])
    assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    n_clip = sum(1 for b in range(B) for t in range(T)
                 if mask[b, t] > 0 and not (1 - lo <= ratios[b][t] <= 1 + hi)
                 and (ratios[b][t] - 1) * adv[b, t].item() > 0)  # clipping binds only on the improving side
    assert stats["clip_frac"] == pytest.approx(n_clip / mask.sum().item())


# ---------------------------------------------------------------- loss aggregation
def test_agg_loss_hand_worked():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token-mean:          (1 + 2 + 3 + 4) / 4 tokens   = 2.5
    # seq-mean-token-sum:  (6 + 4) / 2 seqs             = 5
    # seq-mean-token-mean: (6/3 + 4/1) / 2 seqs         = 3
    assert_close(agg_loss(loss, mask, "token-mean"), torch.tensor(2.5))
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum"), torch.tensor(5.0))
    assert_close(agg_loss(loss, mask, "seq-mean-token-mean"), torch.tensor(3.0))
    # explicit denominators: 10 / 8 tokens; 10 / 4 seqs; 6 / 3 seqs
    assert_close(agg_loss(loss, mask, "token-mean", num_tokens=8), torch.tensor(1.25))
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=4), torch.tensor(2.5))
    assert_close(agg_loss(loss, mask, "seq-mean-token-mean", num_seqs=3), torch.tensor(2.0))


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 2), "sum")


def _ref_agg(loss, mask, mode):
    rows = [[v for v, m in zip(lr, mr) if m > 0] for lr, mr in zip(loss.tolist(), mask.tolist())]
    if mode == "token-mean":
        toks = [x for r in rows for x in r]
        return sum(toks) / len(toks)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def _random_batch(seed, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g)
    lengths = [5, 1, 3, 4, 2, 5][:B]
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    return loss, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_reference_random(mode):
    loss, mask = _random_batch(11)
    assert agg_loss(loss, mask, mode).item() == pytest.approx(_ref_agg(loss, mask, mode), rel=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_micro_batches_sum_to_mini_batch_loss(mode):
    loss, mask = _random_batch(12)
    full = agg_loss(loss, mask, mode)
    counts = {"num_tokens": mask.sum().item(), "num_seqs": loss.shape[0]}
    # uneven micro-batches (different token counts) so that local denominators would be wrong
    parts = [agg_loss(loss[a:b], mask[a:b], mode, **counts) for a, b in ((0, 1), (1, 4), (4, 6))]
    assert_close(sum(parts), full)
    # sanity: with local denominators the micro-batch losses do not add up to the full loss
    local = sum(agg_loss(loss[a:b], mask[a:b], mode) for a, b in ((0, 1), (1, 4), (4, 6)))
    assert not torch.allclose(local, full)


# ---------------------------------------------------------------- value loss
def test_value_loss_clipped_hand_worked():
    clip = 0.2
    values = torch.tensor([[1.0, 1.0, 0.0, 1.0, 2.0]])
    old = torch.tensor([[0.5, 0.9, 0.5, 0.5, 0.0]])
    returns = torch.tensor([[1.2, 0.0, 0.0, 0.5, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    # V_clip = V_old + clamp(V - V_old, ±0.2); loss = 0.5 * max((V-R)^2, (V_clip-R)^2)
    #  V=1, Vo=.5, R=1.2: Vc=.7; (.2)^2=.04 vs (.5)^2=.25 -> .125   clipped term wins
    #  V=1, Vo=.9, R=0  : Vc=1 (inside); 1 vs 1          -> .5     not clipped
    #  V=0, Vo=.5, R=0  : Vc=.3; 0 vs .09                -> .045   clipped term wins
    #  V=1, Vo=.5, R=.5 : Vc=.7; .25 vs .04              -> .125   unclipped wins
    #  padding V=2, Vo=0, R=5: Vc=.2; 9 vs 23.04         -> 11.52  (not counted in vf_clip_frac)
    loss, stats = value_loss(values, old, returns, mask, clip)
    assert_close(loss, torch.tensor([[0.125, 0.5, 0.045, 0.125, 11.52]]))
    assert stats["vf_clip_frac"] == pytest.approx(2 / 4)


def test_value_loss_matches_reference_random():
    g = torch.Generator().manual_seed(13)
    v, vo, r = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.ones(3, 4)
    loss, _ = value_loss(v, vo, r, mask, 0.3)
    ref = [[0.5 * max((a - c) ** 2, (b + min(max(a - b, -0.3), 0.3) - c) ** 2)
            for a, b, c in zip(ra, rb, rc)] for ra, rb, rc in zip(v.tolist(), vo.tolist(), r.tolist())]
    assert_close(loss, torch.tensor(ref), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- entropy
def test_entropy_matches_categorical():
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(2, 3, 7, generator=g) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert_close(entropy_from_logits(logits), expected, atol=1e-5, rtol=1e-5)


def test_entropy_hand_worked_and_stable():
    # uniform over 4 -> log 4; one-hot-ish huge logits -> 0 without NaN/inf
    assert_close(entropy_from_logits(torch.zeros(1, 1, 4)), torch.full((1, 1), math.log(4)))
    out = entropy_from_logits(torch.tensor([[[1000.0, 0.0, 0.0]]]))
    assert torch.isfinite(out).all()
    assert_close(out, torch.zeros(1, 1), atol=1e-5, rtol=0)
    # two outcomes with p = (0.25, 0.75): H = -(.25 ln .25 + .75 ln .75) = 0.562335
    p = torch.tensor([[[0.25, 0.75]]])
    assert_close(entropy_from_logits(p.log()), torch.tensor([[0.562335]]), atol=1e-5, rtol=1e-5)
