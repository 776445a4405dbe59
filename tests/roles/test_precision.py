"""The trainer's numerical paths: the chunked log-prob head and activation checkpointing compute the
same update as the plain full-logits forward; bf16 keeps fp32 master weights and a bf16 rollout copy."""
from __future__ import annotations

import pytest
import torch

import rlbench_nb as rl

KEYS = ("reward/mean", "loss/policy", "loss/kl", "entropy", "actor/grad_norm", "actor/clip_frac", "kl/ref")


def _row(row: dict) -> dict:
    return {k: row.get(k) for k in KEYS}


def _step(cfg):
    """One step: its metrics and the update each weight tensor received."""
    sess = rl.Session(cfg)
    model = sess.groups["policy"].workers[0].model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    row = sess.step()
    delta = {k: v - before[k] for k, v in model.state_dict().items()}
    sess.close()
    return _row(row), delta


def test_chunked_head_and_activation_checkpointing_give_the_same_update(small_cfg):
    # 0.0005 MiB of fp32 logits at V=18: 7 tokens per chunk, so a micro-batch spans many chunks
    base = ["run.tensorboard=false", "algo.kl_coef=0.05", "algo.entropy_coef=0.01", "train.lr=1e-2",
            "train.micro_batch_size=8"]
    ref_row, ref_w = _step(small_cfg(*base, "train.logprob_chunk_mb=0"))
    for variant in (["train.logprob_chunk_mb=0.0005"], ["train.logprob_chunk_mb=0.0005", "train.activation_checkpointing=true"]):
        row, w = _step(small_cfg(*base, *variant))
        assert row == pytest.approx(ref_row, rel=1e-4, abs=1e-6), variant
        for k in ref_w:
            # compared as whole-tensor updates: Adam's first step is ~lr * sign(grad), so a gradient
            # entry of ~1e-9 may flip between two exact-in-math computations; the update as a whole may not
            assert (w[k] - ref_w[k]).norm() <= 1e-2 * ref_w[k].norm() + 1e-7, (variant, k)


def test_reused_logprobs_skip_the_prepare_forward_and_give_the_same_update(small_cfg):
    base = ["run.tensorboard=false", "algo.entropy_coef=0.01", "train.lr=1e-2"]
    ref_row, ref_w = _step(small_cfg(*base))
    row, w = _step(small_cfg(*base, "algo.reuse_logprobs=true"))
    assert row == pytest.approx(ref_row, rel=1e-5, abs=1e-7)
    for k in ref_w:
        assert (w[k] - ref_w[k]).norm() <= 1e-3 * ref_w[k].norm() + 1e-7, k
    sess = rl.Session(small_cfg(*base, "algo.reuse_logprobs=true"))
    assert "old_logprobs_BR" not in sess.prepare(sess.score(sess.rollout()))  # no extra forward was run
    sess.close()


def test_bfloat16_keeps_fp32_masters_and_syncs_a_bf16_rollout_copy(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false", "model.dtype=bfloat16", "train.lr=1e-2"))
    policy = sess.groups["policy"].workers[0]
    rollout = sess.groups["rollout"].workers[0].model
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    assert {p.dtype for p in rollout.parameters()} == {torch.bfloat16}
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    row = sess.step()
    assert row["update/skipped"] == 0 and torch.isfinite(torch.tensor(row["loss/policy"]))
    after = policy.model.state_dict()
    assert sum(not torch.equal(before[k], after[k]) for k in before) >= len(before) // 2
    for k, v in rollout.state_dict().items():  # the rollout copy is the new master, rounded to bf16
        assert torch.equal(v, after[k].to(torch.bfloat16)), k
    # the trainer really computes in bf16: its log-probs differ from an fp32 forward by bf16 rounding
    batch = sess.prepare(sess.score(sess.rollout()))
    m = batch["response_mask_BR"].bool()
    diff = (batch["rollout_logprobs_BR"][m] - batch["old_logprobs_BR"][m]).abs().max()
    assert 0 < diff < 0.5
    sess.close()


def test_shared_prompt_prefix_gives_the_same_logprobs_gradients_and_update(small_cfg):
    """Each distinct prompt runs once and its KV cache serves its rollout.n responses: the same numbers as
    whole sequences, with the gradient reaching the prompt positions through the cache."""
    base = ["run.tensorboard=false", "algo.kl_coef=0.05", "algo.entropy_coef=0.01", "train.lr=1e-2"]
    ref_row, ref_w = _step(small_cfg(*base, "train.share_prompt_prefix=false"))
    row, w = _step(small_cfg(*base))
    assert row == pytest.approx(ref_row, rel=1e-4, abs=1e-6)
    for k in ref_w:
        assert (w[k] - ref_w[k]).norm() <= 1e-3 * ref_w[k].norm() + 1e-7, k

    sess = rl.Session(small_cfg("run.tensorboard=false"))
    policy = sess.groups["policy"].workers[0]
    batch = sess.score(sess.rollout())
    mask = batch["response_mask_BR"].bool()
    rows_seen = []
    hook = policy.model.get_input_embeddings().register_forward_hook(lambda m, i, o: rows_seen.append(tuple(i[0].shape)))
    out = {}
    for share in (False, True):
        policy.scorer.share_prefix = share
        policy.model.zero_grad()
        rows_seen.clear()
        lp, ent = policy._forward(batch, with_entropy=True)
        ((lp * mask).sum() + 0.3 * (ent * mask).sum()).backward()
        out[share] = lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters()}
        shapes = list(rows_seen)
    hook.remove()
    P, R = batch["prompt_ids_BP"].shape[1], batch["response_ids_BR"].shape[1]
    assert shapes == [(8, P), (32, R - 1)]  # 8 distinct prompts once, then only the 8 x 4 responses
    torch.testing.assert_close(out[True][0][mask], out[False][0][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[True][1][mask], out[False][1][mask], rtol=0, atol=1e-5)
    for name, g in out[False][2].items():
        assert (out[True][2][name] - g).norm() <= 1e-4 * g.norm() + 1e-8, name
    assert out[False][2]["model.embed_tokens.weight"].norm() > 0  # the prompt's embeddings got gradient
    sess.close()
