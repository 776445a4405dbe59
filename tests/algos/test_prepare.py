"""prepare()'s math (algos/prepare.py) on tensors, against values worked by hand: no session, no workers.

Four samples in two groups; response lengths 2, 3, 1, 2 of 3 positions. Dr. GRPO (no std division), so a
change in a sequence's summed reward shows in its advantage one for one. float32 inputs of small exact
values: 1e-6 relative holds on any CPU."""
import pytest
import torch

from rlbench_nb.algos.prepare import advantages_for
from rlbench_nb.config import AlgoConfig
from rlbench_nb.data.batch import Batch

MASK = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])


def _batch(**more) -> Batch:
    info = more.pop("info", {})
    return Batch({"response_mask_BR": MASK, "scores_B": torch.tensor([1.0, 0, 1, 0]), **more},
                 {"group": [0, 0, 1, 1]}, info)


def _algo(**kw) -> AlgoConfig:
    return AlgoConfig(advantage="grpo", norm_adv_by_std=False, **kw)


def test_outcome_rewards_sit_on_the_last_token_and_advantages_cover_the_response():
    out = advantages_for(_batch(), Batch(), _algo(), uses_reference=False, kl_coef=0.0)
    rewards = out.tensors["token_rewards_BR"]
    assert rewards.tolist() == [[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]
    adv = [0.5, -0.5, 0.5, -0.5]  # each score minus its group's mean
    torch.testing.assert_close(out.tensors["advantages_BR"], torch.tensor(adv)[:, None] * MASK)
    assert out.advantage == pytest.approx(adv)
    assert out.kl_current is None and "returns_BR" not in out.tensors and "is_weights_BR" not in out.tensors
    assert out.metrics == {}  # no reference: no KL coefficient to report


def test_kl_in_the_reward_lowers_the_penalised_sequences_advantage():
    old = torch.zeros(4, 3)
    ref = torch.zeros(4, 3)
    ref[0, 0] = -1.0  # k1 = old - ref: one token of KL 1 on sample 0; ref[1, 2]'s padding neighbour stays 0
    ref[2, 2] = -5.0  # padding of sample 2: must not count
    forwards = Batch({"old_logprobs_BR": old, "ref_logprobs_BR": ref})
    out = advantages_for(_batch(), forwards, _algo(kl_in="reward", kl_estimator="k1"), uses_reference=True,
                         kl_coef=0.5)
    assert out.tensors["token_rewards_BR"][0].tolist() == [-0.5, 1.0, 0.0]  # 1 on the last token, -0.5 * KL
    # group 0's summed rewards 0.5 and 0: advantages +-0.25 (not +-0.5 as without the KL)
    assert out.advantage == pytest.approx([0.25, -0.25, 0.5, -0.5])
    assert out.metrics["kl/ref"] == pytest.approx(1 / 8)   # one KL of 1 over 8 response tokens
    assert out.kl_current == pytest.approx((1 / 2) / 4)    # per-sequence means (1/2, 0, 0, 0), averaged
    assert out.metrics["kl/coef"] == 0.5


def test_kl_in_the_loss_is_measured_but_leaves_the_rewards():
    forwards = Batch({"old_logprobs_BR": torch.zeros(4, 3), "ref_logprobs_BR": -torch.ones(4, 3)})
    out = advantages_for(_batch(), forwards, _algo(kl_estimator="k1"), uses_reference=True, kl_coef=0.5)
    assert out.advantage == pytest.approx([0.5, -0.5, 0.5, -0.5])
    assert out.metrics["kl/ref"] == pytest.approx(1.0) and out.kl_current == pytest.approx(1.0)
    # the update's own forward measures it when prepare has no old log-probs (algo.reuse_logprobs)
    reused = advantages_for(_batch(), Batch({"ref_logprobs_BR": -torch.ones(4, 3)}), _algo(), uses_reference=True,
                            kl_coef=0.5)
    assert "kl/ref" not in reused.metrics and reused.kl_current is None and reused.metrics["kl/coef"] == 0.5


def test_engine_mismatch_and_truncated_importance_weights():
    rollout = torch.zeros(4, 3)
    rollout[1, 0] = -1.0  # the engine gave this token log-prob -1, the trainer 0: ratio e, capped at 2
    forwards = Batch({"old_logprobs_BR": torch.zeros(4, 3)})
    out = advantages_for(_batch(rollout_logprobs_BR=rollout), forwards, _algo(rollout_is="tis", rollout_is_cap=2.0),
                         uses_reference=False, kl_coef=0.0)
    assert out.metrics["mismatch/logp_abs_mean"] == pytest.approx(1 / 8)
    assert out.metrics["mismatch/logp_abs_max"] == pytest.approx(1.0)
    assert out.tensors["is_weights_BR"][1].tolist()[0] == pytest.approx(2.0)
    assert out.tensors["is_weights_BR"][0].tolist()[:2] == pytest.approx([1.0, 1.0])
    # one step off-policy the engine's log-probs are the old ones: nothing to compare
    off = advantages_for(_batch(rollout_logprobs_BR=rollout, info={"off_policy": True}), forwards,
                         _algo(rollout_is="tis"), uses_reference=False, kl_coef=0.0)
    assert not any(k.startswith("mismatch/") for k in off.metrics) and "is_weights_BR" not in off.tensors


def test_environment_tokens_get_no_advantage_and_do_not_count():
    loss_mask = MASK.clone()
    loss_mask[1, 1] = 0.0  # sample 1's middle token came from the environment
    out = advantages_for(_batch(loss_mask_BR=loss_mask), Batch(), _algo(), uses_reference=False, kl_coef=0.0)
    assert out.tensors["advantages_BR"][1].tolist() == [-0.5, 0.0, -0.5]
    assert out.advantage[1] == pytest.approx(-0.5)  # the mean over the model's own two tokens
    # the reward still sits on the sequence's last token, an environment token or not
    assert out.tensors["token_rewards_BR"][1].tolist() == [0.0, 0.0, 0.0]


def test_episodes_with_per_token_returns_are_refused_by_name():
    # replayed episodes (env tokens between turns) under gae / reinforce_pp: returns and whitening would run across
    # the environment's tokens; grpo and rloo take each sequence's score and mask the env tokens out
    from rlbench_nb.errors import UsageError
    episodes = _batch(loss_mask_BR=torch.tensor([[1.0, 0, 0], [1, 0, 1], [1, 0, 0], [1, 1, 0]]))
    with pytest.raises(UsageError, match="algo.advantage=reinforce_pp computes per-token returns across them"):
        advantages_for(episodes, Batch(), AlgoConfig(advantage="reinforce_pp"), uses_reference=False, kl_coef=0.0)
    out = advantages_for(episodes, Batch(), _algo(), uses_reference=False, kl_coef=0.0)
    assert out.tensors["advantages_BR"][1].tolist() == [-0.5, 0.0, -0.5]  # no advantage on the env's token
