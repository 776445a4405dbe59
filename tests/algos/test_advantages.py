"""Advantage estimators (rlbench_nb/algos/advantages.py) and the masked helpers they use.

Each estimator is pinned twice: on small hand-worked numbers (arithmetic in the comments) and
against a plain-Python loop written here from the textbook / verl `core_algos.py` definition,
on random inputs whose masks have padding.
"""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from rlbench_nb.algos import (
    ADVANTAGES,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rlbench_nb.algos.advantages import discounted_returns

EPS = 1e-6  # grpo_advantages' default eps (verl's epsilon)


def _cfg(**kw):
    base = dict(norm_adv_by_std=True, gamma=1.0, lam=1.0)
    base.update(kw)
    return SimpleNamespace(**base)


def _right_padded_mask(lengths, T):
    return torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])


# ---------------------------------------------------------------- plain-Python references
def _ref_whiten(values_by_pos: dict) -> dict:
    """(x - mean) / sqrt(unbiased var + 1e-8) over the given entries (verl masked_whiten)."""
    xs = list(values_by_pos.values())
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return {k: (x - mean) / math.sqrt(var + 1e-8) for k, x in values_by_pos.items()}


def _ref_grpo(scores, ids, norm_by_std):
    groups: dict = {}
    for s, g in zip(scores, ids):
        groups.setdefault(g, []).append(s)
    out = []
    for s, g in zip(scores, ids):
        xs = groups[g]
        n = len(xs)
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(xs) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        out.append((s - mean) / (std + EPS) if norm_by_std else s - mean)
    return out


def _ref_rloo(scores, ids):
    """r_i minus the mean of the *other* samples of the same prompt (leave-one-out baseline)."""
    out = []
    for i, (s, g) in enumerate(zip(scores, ids)):
        others = [scores[j] for j in range(len(scores)) if ids[j] == g and j != i]
        out.append(s - sum(others) / len(others) if others else s)
    return out


def _ref_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE on each row's valid tokens only (padding skipped, as verl's carry-through does).
    Returns {(b, t): A_t} for valid positions, un-whitened."""
    adv = {}
    for b in range(len(rewards)):
        ts = [t for t in range(len(rewards[b])) if mask[b][t] > 0]
        next_v, next_a = 0.0, 0.0
        for t in reversed(ts):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            a = delta + gamma * lam * next_a
            adv[(b, t)] = a
            next_v, next_a = values[b][t], a
    return adv


def _ref_discounted(rewards, mask, gamma):
    """G_t = sum_k gamma^k r_{t+k} over a row's valid (right-padded) tokens; {(b, t): G_t}."""
    out = {}
    for b in range(len(rewards)):
        ts = [t for t in range(len(rewards[b])) if mask[b][t] > 0]
        g = 0.0
        for t in reversed(ts):
            g = rewards[b][t] + gamma * g
            out[(b, t)] = g
    return out


def _to_tensor(by_pos: dict, B, T):
    x = torch.zeros(B, T)
    for (b, t), v in by_pos.items():
        x[b, t] = v
    return x


# ---------------------------------------------------------------- masked helpers
def test_masked_mean_var_whiten_hand_worked():
    # valid entries 1, 2, 3 (the 100 is padding): mean 2, unbiased var ((1+0+1)/2) = 1
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert_close(masked_mean(x, m), torch.tensor(2.0))
    assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 3.0]))
    assert_close(masked_var(x, m), torch.tensor(1.0))
    assert_close(masked_var(x, m, unbiased=False), torch.tensor(2.0 / 3.0))
    # whiten: (x - 2) / sqrt(1 + 1e-8) on valid entries; shift_mean=False adds the mean back
    w = masked_whiten(x, m)
    assert_close(w[m.bool()], torch.tensor([-1.0, 0.0, 1.0]))
    assert_close(masked_whiten(x, m, shift_mean=False)[m.bool()], torch.tensor([1.0, 2.0, 3.0]))


def test_masked_whiten_of_equal_entries_is_exactly_zero():
    # 256 x 512 returns of 0.7: their fp32 mean rounds, and / sqrt(1e-8) made the residue ~1e-3 on every token
    x, m = torch.full((256, 512), 0.7), torch.ones(256, 512)
    m[:, 300:] = 0
    assert torch.equal(masked_whiten(x, m) * m, torch.zeros(256, 512))
    assert_close(masked_whiten(x, m, shift_mean=False)[m.bool()], torch.full((256 * 300,), 0.7))


def test_masked_whiten_matches_reference_random():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g) * 3 + 1
    m = (torch.rand(4, 6, generator=g) > 0.4).float()
    m[0, 0] = m[1, 1] = 1.0
    ref = _ref_whiten({(b, t): x[b, t].item() for b in range(4) for t in range(6) if m[b, t] > 0})
    w = masked_whiten(x, m)
    for (b, t), v in ref.items():
        assert w[b, t].item() == pytest.approx(v, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------- GRPO / Dr. GRPO
def test_grpo_hand_worked():
    # ids interleaved: group "a" = [1, 0, 0, 1], group "b" = [2, 0], group "c" = [3] (single sample)
    ids = ["a", "b", "a", "c", "a", "b", "a"]
    scores = torch.tensor([1.0, 2.0, 0.0, 3.0, 0.0, 0.0, 1.0])
    # a: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735 -> ±0.5 / 0.57735 = ±0.866025
    # b: mean 1, unbiased std sqrt((1 + 1) / 1) = 1.41421 -> ±1 / 1.41421 = ±0.707107
    # c: single sample -> mean 0, std 1 -> 3 / (1 + eps)
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    b = 1.0 / (math.sqrt(2.0) + EPS)
    expected = torch.tensor([a, b, -a, 3.0 / (1 + EPS), -a, -b, a])
    assert_close(grpo_advantages(scores, ids), expected)
    assert abs(a - 0.866025) < 1e-5 and abs(b - 0.707107) < 1e-5


def test_dr_grpo_no_std_hand_worked():
    # Dr. GRPO: r - group mean only. a: [1,0,0,1] - 0.5; b: [2,0] - 1; c: single -> r - 0
    ids = ["a", "b", "a", "c", "a", "b", "a"]
    scores = torch.tensor([1.0, 2.0, 0.0, 3.0, 0.0, 0.0, 1.0])
    expected = torch.tensor([0.5, 1.0, -0.5, 3.0, -0.5, -1.0, 0.5])
    assert_close(grpo_advantages(scores, ids, norm_by_std=False), expected)


def test_grpo_constant_group_is_zero_and_single_sample_group():
    # all-equal group: r - mean = 0, std 0 -> 0 / eps = 0 (no NaN)
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0]), [7, 7, 7])
    assert_close(adv, torch.zeros(3))
    # a lone sample: mean 0, std 1 (not its own mean -> not 0)
    assert_close(grpo_advantages(torch.tensor([0.7]), ["x"]), torch.tensor([0.7 / (1 + EPS)]))
    assert_close(grpo_advantages(torch.tensor([0.7]), ["x"], norm_by_std=False), torch.tensor([0.7]))


@pytest.mark.parametrize("value", [0.2, 0.7, 1.2])
def test_a_tie_group_gets_exactly_zero_where_its_mean_rounds(value):
    # eight equal fp32 scores sum to a value that / 8 is not the score (0.2 * 8 -> 1.6000001): r - mean was
    # ~1e-8, its std as small, and GRPO gave the tie an advantage of 0.015-0.11 (the format-only group of the
    # GSM8K reward, 0.2 each, is the common case); beside it a group with a spread keeps its advantages
    ids = ["tie"] * 8 + ["spread"] * 4
    scores = torch.tensor([value] * 8 + [1.0, 0.0, 0.0, 1.0])
    for adv in (grpo_advantages(scores, ids), grpo_advantages(scores, ids, norm_by_std=False),
                rloo_advantages(scores, ids)):
        assert torch.equal(adv[:8], torch.zeros(8))
        assert adv[8] > 0.4 and adv[9] < -0.4


def test_the_prepare_metrics_count_the_tied_groups():
    # a: four answers in the format only (0.2 each), b: a spread, c: all wrong -> a and c teach nothing
    from rlbench_nb.data.batch import Batch
    from rlbench_nb.metrics.compute import advantage_metrics
    groups = ["a", "b", "c", "a", "b", "c", "a", "b", "c", "a", "b", "c"]
    scores = torch.tensor([0.2, 1.2, 0.0, 0.2, 0.2, 0.0, 0.2, 0.0, 0.0, 0.2, 1.2, 0.0])
    adv = grpo_advantages(scores, groups)
    batch = Batch({"scores_B": scores, "advantages_BR": adv[:, None].repeat(1, 3),
                   "response_mask_BR": torch.ones(12, 3, dtype=torch.long)}, {"group": groups})
    m = advantage_metrics(batch)
    assert m["advantage/tied_groups"] == pytest.approx(2 / 3)
    # the same test the advantages use: exactly the tied groups got 0 (a and c), b did not
    assert adv[[0, 3, 6, 9, 2, 5, 8, 11]].eq(0).all() and adv[[1, 4, 7, 10]].ne(0).all()
    assert m["advantage/abs_max"] == pytest.approx(adv.abs().max().item()) and adv.abs().max() > 0.5


def test_rewards_finite_in_fp32_whose_difference_is_not_get_finite_advantages():
    # +-3e38 fit fp32 (max 3.4e38) but their difference does not: group statistics in fp32 gave inf - inf = NaN
    # advantages (and a NaN loss); in float64 group a is two against two: +-1/sqrt(4/3) each, Dr. GRPO +-3e38
    ids = ["a"] * 4 + ["b"] * 2
    scores = torch.tensor([3e38, -3e38, 3e38, -3e38, 3e38, 3e38])
    a = 1 / math.sqrt(4 / 3)
    assert_close(grpo_advantages(scores, ids), torch.tensor([a, -a, a, -a, 0.0, 0.0]))
    assert torch.equal(grpo_advantages(scores, ids, norm_by_std=False), scores * torch.tensor([1, 1, 1, 1, 0, 0]))


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference_random(norm_by_std):
    rng = random.Random(1)
    sizes = [4, 1, 3, 2, 5]
    ids = [f"p{g}" for g, n in enumerate(sizes) for _ in range(n)]
    rng.shuffle(ids)
    scores = [rng.uniform(-2, 2) for _ in ids]
    ref = torch.tensor(_ref_grpo(scores, ids, norm_by_std))
    assert_close(grpo_advantages(torch.tensor(scores), ids, norm_by_std=norm_by_std), ref)


# ---------------------------------------------------------------- RLOO
def test_rloo_hand_worked():
    # a = [1, 0, 0, 1]: n=4, mean 0.5 -> 4/3 * (±0.5) = ±2/3
    #    (check r0: 1 - mean(0, 0, 1) = 1 - 1/3 = 2/3)
    # b = [3, 0, 3]: n=3, mean 2 -> 3/2 * (1) = 1.5, 3/2 * (-2) = -3
    #    (check r1: 0 - mean(3, 3) = -3)
    # c = [5]: a group of one keeps its raw score
    ids = ["a", "b", "a", "b", "c", "a", "b", "a"]
    scores = torch.tensor([1.0, 3.0, 0.0, 0.0, 5.0, 0.0, 3.0, 1.0])
    expected = torch.tensor([2 / 3, 1.5, -2 / 3, -3.0, 5.0, -2 / 3, 1.5, 2 / 3])
    assert_close(rloo_advantages(scores, ids), expected)


def test_rloo_matches_reference_random():
    rng = random.Random(2)
    sizes = [2, 4, 1, 3]
    ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    rng.shuffle(ids)
    scores = [rng.uniform(-1, 3) for _ in ids]
    assert_close(rloo_advantages(torch.tensor(scores), ids), torch.tensor(_ref_rloo(scores, ids)))


# ---------------------------------------------------------------- REINFORCE++
def test_discounted_returns_hand_worked_restart_per_row():
    gamma = 0.5
    # row 0: valid t0..t2, reward 1 at t2     -> G = [0.25, 0.5, 1]
    # row 1: valid t0..t1, reward 1 at t1, and a stray 7 on padding t3 that must not leak
    #        into row 1's valid tokens        -> G = [0.5, 1]
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    G = discounted_returns(rewards, mask, gamma)
    assert_close(G[mask.bool()], torch.tensor([0.25, 0.5, 1.0, 0.5, 1.0]))


def test_reinforce_pp_hand_worked():
    gamma = 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # returns on valid tokens [0.25, 0.5, 1 | 0.5, 1]; batch whitening over those 5:
    # mean 3.25/5 = 0.65; deviations [-0.4, -0.15, 0.35, -0.15, 0.35];
    # squares sum 0.45 -> unbiased var 0.45/4 = 0.1125, std 0.335410
    # -> [-1.192570, -0.447214, 1.043498, -0.447214, 1.043498]; padding -> 0
    expected = torch.tensor([[-1.192570, -0.447214, 1.043498, 0.0],
                             [-0.447214, 1.043498, 0.0, 0.0]])
    assert_close(reinforce_pp_advantages(rewards, mask, gamma), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference_random(gamma):
    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    lengths = [7, 3, 5, 1, 4]
    mask = _right_padded_mask(lengths, T)
    rewards = torch.randn(B, T, generator=g)  # garbage on padding as well
    ref = _to_tensor(_ref_whiten(_ref_discounted(rewards.tolist(), mask.tolist(), gamma)), B, T)
    out = reinforce_pp_advantages(rewards, mask, gamma)
    assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[mask == 0] == 0)


# ---------------------------------------------------------------- GAE
def test_gae_hand_worked():
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    # one row, valid t0..t2, trailing padding with a garbage value 9 and reward 5
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # t2: delta = 1 + 0.9*0 - 0.7 = 0.3                      A2 = 0.3
    # t1: delta = 0 + 0.9*0.7 - 0.6 = 0.03                   A1 = 0.03 + 0.72*0.3 = 0.246
    # t0: delta = 0 + 0.9*0.6 - 0.5 = 0.04                   A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    assert_close(ret[0, :3], torch.tensor([0.71712, 0.846, 1.0]))
    # whitened A: mean 0.254373, unbiased var 0.00176986 -> [-0.885512, -0.199034, 1.084547]
    assert_close(adv, torch.tensor([[-0.885512, -0.199034, 1.084547, 0.0]]), atol=1e-5, rtol=1e-5)


def test_gae_padding_in_the_middle_carries_value_and_advantage_through():
    gamma, lam = 0.9, 0.8
    # valid t0 and t2, padding at t1 (garbage reward 5, value 9 must be skipped)
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    # t2: A2 = 1 - 0.7 = 0.3
    # t0: delta = 0 + 0.9 * V(t2)=0.7 - 0.5 = 0.13; A0 = 0.13 + 0.72 * A(t2)=0.3 = 0.346
    # returns at valid tokens: 0.346 + 0.5 = 0.846, 0.3 + 0.7 = 1.0
    _, ret = gae_advantages(rewards, values, mask, gamma, lam)
    assert_close(ret[0, [0, 2]], torch.tensor([0.846, 1.0]))


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_reference_random(gamma, lam):
    g = torch.Generator().manual_seed(4)
    B, T = 4, 8
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = _right_padded_mask([8, 5, 2, 6], T)
    mask[3, 2] = 0.0  # an interior padding token (e.g. an observation token)
    ref_adv = _ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    valid = mask.bool()
    # returns = un-whitened advantages + values on the valid tokens
    assert_close(ret[valid], (_to_tensor(ref_adv, B, T) + values)[valid], atol=1e-5, rtol=1e-5)
    # advantages are whitened over the batch's valid tokens and zero on padding
    assert_close(adv, _to_tensor(_ref_whiten(ref_adv), B, T), atol=1e-5, rtol=1e-5)
    assert torch.all(adv[~valid] == 0)


# ---------------------------------------------------------------- registry
def test_registry_names():
    # the built-ins (a session's @sess.advantage adds its own to the process's registry)
    assert {"grpo", "rloo", "reinforce_pp", "gae"} <= set(ADVANTAGES)


@pytest.mark.parametrize("norm", [True, False])
def test_compute_advantages_grpo_broadcasts_outcome_to_tokens(norm):
    # outcome score = sum of token rewards; rows 0,1 in group "a", row 2 alone
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    ids = ["a", "a", "b"]
    adv, ret = compute_advantages("grpo", rewards, mask, group_ids=ids, cfg=_cfg(norm_adv_by_std=norm))
    assert ret is None
    # scores [1, 0 | 2]: "a" mean .5, std .7071 -> ±0.7071 (±0.5 without std); "b" single: 2/(1+eps) (2)
    a = 0.5 / (math.sqrt(0.5) + EPS) if norm else 0.5
    c = 2.0 / (1 + EPS) if norm else 2.0
    expected = torch.tensor([[a, a, a], [-a, -a, 0.0], [c, c, 0.0]])
    assert_close(adv, expected)


def test_compute_advantages_rloo_broadcasts_and_zeroes_padding():
    rewards = torch.tensor([[0.0, 3.0], [1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    # scores [3, 1, 0] in one group: mean 4/3, 3/2 * (r - 4/3) = [2.5, -0.5, -2]
    adv, ret = compute_advantages("rloo", rewards, mask, group_ids=[0, 0, 0], cfg=_cfg())
    assert ret is None
    assert_close(adv, torch.tensor([[2.5, 2.5], [-0.5, 0.0], [-2.0, -2.0]]))


def test_compute_advantages_dispatches_token_level_estimators():
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(3, 5, generator=g)
    values = torch.randn(3, 5, generator=g)
    mask = _right_padded_mask([5, 3, 4], 5)
    cfg = _cfg(gamma=0.9, lam=0.7)
    adv, ret = compute_advantages("reinforce_pp", rewards, mask, group_ids=[0, 1, 2], cfg=cfg)
    assert ret is None
    assert_close(adv, reinforce_pp_advantages(rewards, mask, 0.9))
    adv, ret = compute_advantages("gae", rewards, mask, group_ids=[0, 1, 2], values_BR=values, cfg=cfg)
    exp_adv, exp_ret = gae_advantages(rewards, values, mask, 0.9, 0.7)
    assert_close(adv, exp_adv)
    assert_close(ret, exp_ret)
    assert torch.all(adv[mask == 0] == 0)


def test_compute_advantages_errors():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(KeyError, match="unknown advantage estimator"):
        compute_advantages("ppo2", r, m, group_ids=[0, 0], cfg=_cfg())
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", r, m, group_ids=[0, 0], values_BR=None, cfg=_cfg())
