"""HF rollout engine: the recorded log-probs are those of the distribution the sampler drew from
(after temperature, top-k and top-p), taken one step at a time."""
from __future__ import annotations

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.roles.rollout.decode_step import DecodeStep

from ..conftest import assert_rollout_holds_policy_weights


def _generate(sess, **params):
    probe = sess.prompts.encode(sess.test_data.rows[:8], 4, "probe")
    return sess.groups["rollout"].call_split("generate", probe, sess.cfg.rollout.model_copy(update=params))


def test_truncated_sampling_draws_inside_the_cut_and_records_the_trainers_log_probs(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    greedy = _generate(sess, temperature=0.0)
    for params in ({"top_k": 1, "temperature": 1.5}, {"top_p": 1e-6, "temperature": 0.7}):
        out = _generate(sess, **params)  # one token left in the support: the greedy one
        assert torch.equal(out["response_ids_BR"], greedy["response_ids_BR"]), params
    # top-k = 2 at T=1: the recorded log-probs are the trainer's (the whole softmax), so the mismatch monitor, TIS
    # and MIS see the engine's numerics only, not the kept mass (a truncated record differed by it on every token)
    torch.manual_seed(0)
    k2 = _generate(sess, top_k=2, temperature=1.0)
    m = k2["response_mask_BR"].bool()
    k2.update(sess.prompts.encode(sess.test_data.rows[:8], 4, "probe"))
    full = sess.groups["policy"].call_split("compute_logprobs", k2)["old_logprobs_BR"]
    torch.testing.assert_close(k2["rollout_logprobs_BR"][m], full[m], atol=1e-5, rtol=0)  # fp32, same weights
    # not vacuous: some drawn token had well under all the mass, where a record renormalised over the two differs
    assert full[m].min() < -0.1
    sess.close()


def test_engine_matches_hf_generate_and_drops_finished_rows(small_cfg):
    """Greedy tokens, EOS handling and padding agree with transformers' own `generate`; the prefill runs
    once per distinct prompt and a row stops being computed once it has sampled EOS."""
    sess = rl.Session(small_cfg("run.tensorboard=false", "rollout.max_new_tokens=6"))
    worker = sess.groups["rollout"].workers[0]
    assert isinstance(worker.decode_step, DecodeStep)  # the built-in Llama on a CPU: decoded by decode_step.py
    probe = sess.prompts.encode(sess.test_data.rows[:10], 3, "probe")  # 10 prompts x 3 copies
    greedy = sess.cfg.rollout.model_copy(update={"temperature": 0.0})
    rows_seen = []
    hook = worker.model.get_input_embeddings().register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[0]))
    out = worker.generate(probe, greedy)
    hook.remove()
    ref = worker.model.generate(input_ids=probe["prompt_ids_BP"], attention_mask=probe["prompt_mask_BP"],
                                do_sample=False, max_new_tokens=6, eos_token_id=worker.eos, pad_token_id=worker.pad)
    ref = ref[:, probe["prompt_ids_BP"].shape[1]:]
    is_eos = ref == worker.eos
    ref_mask = ((is_eos.long().cumsum(-1) - is_eos.long()) == 0).long()
    assert torch.equal(out["response_mask_BR"], ref_mask)
    assert torch.equal(out["response_ids_BR"], ref.masked_fill(ref_mask == 0, worker.pad))
    assert rows_seen[0] == 10  # prefill: distinct prompts only
    # sampled at a high temperature, rows stop at different steps: each decode step runs exactly the rows
    # that have not sampled EOS yet
    torch.manual_seed(0)
    rows_seen.clear()
    hook = worker.model.get_input_embeddings().register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[0]))
    lengths = worker.generate(
        probe, sess.cfg.rollout.model_copy(update={"temperature": 3.0}))["response_mask_BR"].sum(-1)
    hook.remove()
    assert len(set(lengths.tolist())) > 1
    assert rows_seen == [10] + [int((lengths > t).sum()) for t in range(1, len(rows_seen))]
    assert min(rows_seen[1:]) < 30
    sess.close()


def test_a_weight_push_lends_the_policys_own_tensors_and_the_engine_keeps_a_copy(small_cfg):
    """The push passes the policy's live tensors (no copy of the model a step); the engine copies them into its
    own, so the next update moves the policy and not the engine. `get_weights()` as people call it is a snapshot."""
    with rl.Session(small_cfg("run.tensorboard=false")) as sess:
        policy, engine = sess.groups["policy"].workers[0], sess.groups["rollout"].workers[0]
        live = {k: v.data_ptr() for k, v in policy.model.state_dict().items()}
        assert {k: v.data_ptr() for k, v in policy.get_weights(copy=False).items()} == live
        assert not {v.data_ptr() for v in policy.get_weights().values()} & set(live.values())
        sess.step()
        assert not {v.data_ptr() for v in engine.model.state_dict().values()} & set(live.values())
        assert_rollout_holds_policy_weights(sess)
        pushed = {k: v.clone() for k, v in engine.model.state_dict().items()}
        sess.update(sess.prepare(sess.score(sess.rollout())))  # pushes again: the engine follows the policy
        assert_rollout_holds_policy_weights(sess)
        assert any(not torch.equal(v, engine.model.state_dict()[k]) for k, v in pushed.items())


def test_a_bf16_engine_gets_pushes_in_bf16_verified_and_samples_near_the_fp32_trainer(small_cfg):
    """rollout.dtype=bfloat16 under a float32 model (what `auto` picks on a CPU with native bf16): the engine holds
    bf16 weights, each push sends bf16 (half the bytes) and is verified in it, a push that does not land is still
    caught, and the engine's log-probs stay within bf16's rounding of the fp32 trainer's."""
    with rl.Session(small_cfg("run.tensorboard=false", "rollout.dtype=bfloat16")) as sess:
        engine = sess.groups["rollout"].workers[0]
        assert engine.model.dtype == torch.bfloat16 and sess.workers.rollout_dtype() == "bfloat16"
        devices = {line.split()[0]: line.split("device=")[1].split(" rss_gb=")[0]
                   for line in repr(sess).splitlines()[1:]}
        assert devices["rollout"] == "cpu bfloat16" and devices["policy"] == "cpu"  # the table says which is bf16
        row = sess.step()
        params = sum(v.numel() for v in sess.groups["policy"].call("get_weights")[0].values())
        assert row["sync/bytes"] == 2 * params and row["sync/verified"] == 1.0
        assert_rollout_holds_policy_weights(sess)
        # bf16 keeps 8 bits of mantissa: every activation rounds by up to 2^-9 relative, so token log-probs move by
        # ~1e-3 (1.3e-3 measured on this 0.7M model, 2.7e-2 on SmolLM2-135M); an fp32 engine stays under 1e-5
        assert 1e-5 < row["mismatch/logp_abs_mean"] < sess.cfg.algo.mismatch_alarm
        engine._targets = {k: v.clone() for k, v in engine._targets.items()}  # a load the model does not see
        with pytest.raises(rl.WeightSyncError, match="differs from what the policy sent"):
            sess.step()
