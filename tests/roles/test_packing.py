"""Padding-free rows (train.pack_sequences) and micro-batches by a token budget: the same log-probs, values,
losses and gradients as the padded forward, on fewer positions."""
from __future__ import annotations

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.config import TrainConfig
from rlbench_nb.data.batch import Batch
from rlbench_nb.roles.packing import micro_batches, pack_sequences

from .test_precision import _assert_grads_close, _assert_rows_close, _step


def test_sequences_are_laid_end_to_end_and_the_predicting_states_are_found():
    # three sequences: prompt lengths 2, 1, 3 (left-padded to 3), responses 2, 3, 1 (right-padded to 3)
    prompt_ids = torch.tensor([[0, 11, 12], [0, 0, 21], [31, 32, 33]])
    prompt_mask = (prompt_ids > 0).long()
    response_ids = torch.tensor([[13, 14, 0], [22, 23, 24], [34, 0, 0]])
    response_mask = (response_ids > 0).long()
    rows = pack_sequences(prompt_ids, prompt_mask, response_ids, response_mask, width=4)
    # lengths 4, 4, 4 in width 4: one sequence per row (first fit by decreasing length, ties in order)
    assert rows.ids_NW.tolist() == [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    assert rows.positions_NW.tolist() == [[0, 1, 2, 3]] * 3

    # lengths 5, 2, 3 in width 5: the 2 and the 3 share a row; the row's positions restart per sequence
    prompt_ids = torch.tensor([[41, 42, 43], [0, 0, 51], [0, 61, 62]])
    response_ids = torch.tensor([[44, 45], [52, 0], [63, 0]])
    rows = pack_sequences(prompt_ids, (prompt_ids > 0).long(), response_ids, (response_ids > 0).long(), width=5)
    assert rows.ids_NW.tolist() == [[41, 42, 43, 44, 45], [61, 62, 63, 51, 52]]
    assert rows.positions_NW.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    # response tokens in [B, R] order: 44, 45 | 52 | 63, each predicted by the column before it
    assert list(zip(rows.rows_K.tolist(), rows.cols_K.tolist())) == [(0, 2), (0, 3), (1, 3), (1, 1)]
    assert rows.scatter(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [[1, 2], [3, 0], [4, 0]]


def test_rows_are_twice_as_wide_as_the_longest_sequence_by_default():
    prompt_ids, response_ids = torch.tensor([[1, 2], [0, 3], [0, 7]]), torch.tensor([[4, 5], [6, 0], [8, 9]])
    rows = pack_sequences(prompt_ids, (prompt_ids > 0).long(), response_ids, (response_ids > 0).long())
    # lengths 4, 2, 3 in width 8: the 4 and the 3 fill 7 of the first row, the 2 does not fit there
    assert rows.ids_NW.tolist() == [[1, 2, 4, 5, 7, 8, 9, 0], [3, 6, 0, 0, 0, 0, 0, 0]]


def test_a_row_with_room_left_restarts_its_positions_in_the_unused_tail():
    prompt_ids, response_ids = torch.tensor([[1, 2], [0, 3]]), torch.tensor([[4, 5], [6, 0]])
    rows = pack_sequences(prompt_ids, (prompt_ids > 0).long(), response_ids, (response_ids > 0).long(), width=4)
    assert rows.ids_NW.tolist() == [[1, 2, 4, 5], [3, 6, 0, 0]]
    assert rows.positions_NW.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]  # the tail is a sequence of its own


def test_a_token_budget_cuts_consecutive_micro_batches():
    lengths = [5, 3, 4, 9, 1]
    batch = Batch({"prompt_mask_BP": torch.ones(5, 1, dtype=torch.long),
                   "response_mask_BR": (torch.arange(8) < torch.tensor(lengths)[:, None] - 1).long(),
                   "prompt_ids_BP": torch.ones(5, 1, dtype=torch.long),
                   "response_ids_BR": torch.ones(5, 8, dtype=torch.long), "i_B": torch.arange(5)})
    def parts(rows, budget, packed):
        t = TrainConfig(micro_batch_size=rows, max_tokens_per_micro_batch=budget, pack_sequences=packed)
        return [p["i_B"].tolist() for p in micro_batches(batch, t)]
    assert parts(100, 8, True) == [[0, 1], [2], [3], [4]]  # 5+3 | 4 (+9 > 8) | 9 alone, over the budget | 1
    assert parts(100, 20, False) == [[0, 1], [2, 3], [4]]  # 9 padded positions a row
    assert [len(p) for p in parts(2, 0, True)] == [2, 2, 1]


@pytest.mark.parametrize("variant", [[], ["train.logprob_chunk_mb=0"], ["train.max_tokens_per_micro_batch=96"]],
                         ids=["chunked-head", "full-logits", "token-budget"])
def test_packed_rows_give_the_padded_update(small_cfg, variant):
    """Same metrics and gradient as the padded forward (share_prompt_prefix off there: packing replaces it).
    Tolerances: test_precision.py's (the same sums in another order)."""
    base = ["run.tensorboard=false", "algo.kl_coef=0.05", "algo.entropy_coef=0.01", "train.lr=1e-2",
            "train.share_prompt_prefix=false", "algo.reuse_logprobs=false"]
    ref_row, ref_g = _step(small_cfg(*base, "train.pack_sequences=false"))
    row, g = _step(small_cfg(*base, "train.pack_sequences=true", *variant))
    _assert_rows_close(row, ref_row)
    _assert_grads_close(g, ref_g)


def test_packed_forward_reads_fewer_positions_and_matches_per_token(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    policy = sess.groups["policy"].workers[0]
    batch = sess.score(sess.rollout())
    # the task's answers are all 3 tokens long: cut some responses short so their lengths vary too
    cut = batch["response_mask_BR"].clone()
    cut[::3, 1:], cut[1::3, 2:] = 0, 0
    batch = batch.replace(response_mask_BR=cut, response_ids_BR=batch["response_ids_BR"] * cut)
    mask = cut.bool()
    assert len(set(mask.sum(1).tolist())) == 3 and len(set(batch["prompt_mask_BP"].sum(1).tolist())) > 1
    policy.scorer.share_prefix = False
    shapes, out = [], {}
    hook = policy.model.get_input_embeddings().register_forward_hook(lambda m, i, o: shapes.append(i[0].shape))
    for pack in (False, True):
        policy.scorer.pack = pack
        policy.model.zero_grad()
        lp, ent = policy._forward(batch, with_entropy=True)
        ((lp * mask).sum() + 0.3 * (ent * mask).sum()).backward()
        out[pack] = lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    hook.remove()
    padded, packed = shapes
    assert packed[0] < len(batch) and packed.numel() <= padded.numel()  # sequences share rows
    assert packed[1] == 2 * int((batch["prompt_mask_BP"].sum(1) + mask.sum(1)).max())  # twice the longest
    assert (out[True][0][~mask] == 0).all()  # zero on padding
    torch.testing.assert_close(out[True][0][mask], out[False][0][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[True][1][mask], out[False][1][mask], rtol=0, atol=1e-5)
    _assert_grads_close(out[True][2], out[False][2])
    sess.close()


def test_packed_critic_gives_the_padded_values_and_update(small_cfg):
    base = ["run.tensorboard=false", "algo.advantage=gae", "train.lr=1e-2", "train.share_prompt_prefix=false",
            "algo.reuse_logprobs=false"]
    rows, grads = {}, {}
    for pack in ("false", "true"):
        sess = rl.Session(small_cfg(*base, f"train.pack_sequences={pack}"))
        critic = sess.groups["critic"].workers[0]
        row = sess.step()
        beta1 = critic.optimizer.param_groups[0]["betas"][0]
        grads[pack] = {n: critic.optimizer.state[p]["exp_avg"] / (1 - beta1)
                       for n, p in critic.model.named_parameters()}
        rows[pack] = {k: row[k] for k in ("loss/value", "critic/grad_norm", "loss/policy", "actor/grad_norm")}
        sess.close()
    _assert_rows_close(rows["true"], rows["false"])
    _assert_grads_close(grads["true"], grads["false"])
