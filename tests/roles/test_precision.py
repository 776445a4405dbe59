"""The trainer's numerical paths: the chunked log-prob head and activation checkpointing compute the
same update as the plain full-logits forward; bf16 keeps fp32 master weights and a bf16 rollout copy."""
from __future__ import annotations

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.data.batch import Batch

KEYS = ("reward/mean", "loss/policy", "loss/kl", "entropy", "actor/grad_norm", "actor/clip_frac", "kl/ref")

# Tolerances. Two computations that are equal in exact arithmetic (chunked vs full logits, recomputed vs
# kept activations, a shared prompt prefix vs whole sequences) differ only in the order of fp32 sums, and
# so does one CPU from another (AVX2 and AVX-512 kernels block their reductions differently). A sum of N
# terms in another order moves by about sqrt(N) * u * sum|terms| typically (u = 2**-24 = 6e-8); here
# N <= ~5e4 (tokens x hidden), so ~1.3e-5 of the magnitudes, before a few layers of amplification.
# 1e-4 (relative, norm-wise) leaves ~8x room on any x86-64 CPU and is still 100x below what a real bug
# (a wrong mask, a dropped token, an off-by-one position) does to a gradient.
# Weights after an Adam step are NOT compared: its first step is lr * g / (|g| + eps), so an entry whose
# gradient is below the rounding noise flips a full +-lr either way. The gradient is compared instead,
# read back exactly from Adam's first moment (after one step from zero: exp_avg = (1 - beta1) * g).
GRAD_RTOL = 1e-4


def _metrics(row: dict) -> dict:
    """The compared metrics this row has: absent ones stay absent (compared as key sets, never as None)."""
    return {k: row[k] for k in KEYS if k in row}


def _assert_rows_close(row: dict, ref: dict, rel: float = 1e-4, abs_: float = 1e-6) -> None:
    assert row.keys() == ref.keys(), (sorted(row), sorted(ref))
    assert row == pytest.approx(ref, rel=rel, abs=abs_)


def _assert_grads_close(grads: dict, ref: dict, rtol: float = GRAD_RTOL) -> None:
    assert grads.keys() == ref.keys()
    for k, g in ref.items():
        assert (grads[k] - g).norm() <= rtol * g.norm() + 1e-12, (k, ((grads[k] - g).norm() / g.norm()).item())


def _step(cfg, with_kl_coef: bool = False):
    """One step (one optimizer step): its metrics and the gradient that step applied, per parameter (and the
    KL controller's coefficient after it)."""
    sess = rl.Session(cfg)
    worker = sess.groups["policy"].workers[0]
    row = sess.step()
    assert row["update/skipped"] == 0
    beta1 = worker.optimizer.param_groups[0]["betas"][0]
    grads = {name: worker.optimizer.state[p]["exp_avg"] / (1 - beta1) for name, p in worker.model.named_parameters()}
    coef = sess.progress.kl.value
    sess.close()
    return (_metrics(row), grads, coef) if with_kl_coef else (_metrics(row), grads)


def test_chunked_head_and_activation_checkpointing_give_the_same_update(small_cfg):
    # 0.0005 MiB of fp32 logits at V=18: 7 tokens per chunk, so a micro-batch spans many chunks
    base = ["run.tensorboard=false", "algo.kl_coef=0.05", "algo.entropy_coef=0.01", "train.lr=1e-2",
            "train.micro_batch_size=8"]
    ref_row, ref_g = _step(small_cfg(*base, "train.logprob_chunk_mb=0"))
    assert "loss/kl" in ref_row
    for variant in (["train.logprob_chunk_mb=0.0005"],
                    ["train.logprob_chunk_mb=0.0005", "train.activation_checkpointing=true"]):
        row, g = _step(small_cfg(*base, *variant))
        _assert_rows_close(row, ref_row)
        _assert_grads_close(g, ref_g)


@pytest.mark.parametrize("kl", [[], ["algo.kl_coef=0.05", "algo.kl_ctrl=adaptive", "algo.target_kl=0.001"]],
                         ids=["no-reference", "kl-loss-adaptive"])
def test_reused_logprobs_skip_the_prepare_forward_and_give_the_same_update(small_cfg, kl):
    """The default (algo.reuse_logprobs, one epoch of one mini-batch) against prepare()'s separate forward: the
    same update, the same metrics — kl/ref measured by the update's forward — and, with an adaptive KL
    controller, the same coefficient after the step (it tracks the KL the update measured)."""
    base = ["run.tensorboard=false", "algo.entropy_coef=0.01", "train.lr=1e-2", *kl]
    ref_row, ref_g, ref_coef = _step(small_cfg(*base, "algo.reuse_logprobs=false"), with_kl_coef=True)
    row, g, coef = _step(small_cfg(*base), with_kl_coef=True)
    assert ("loss/kl" in ref_row and "kl/ref" in ref_row) == bool(kl)  # no reference model: no KL metrics
    _assert_rows_close(row, ref_row)
    _assert_grads_close(g, ref_g)
    assert coef == pytest.approx(ref_coef, rel=1e-6)  # the controller was given a KL (0: policy == reference)
    if kl:
        assert coef != 0.05
    sess = rl.Session(small_cfg(*base))
    assert "old_logprobs_BR" not in sess.prepare(sess.score(sess.rollout()))  # no extra forward was run
    sess.close()
    kl_reward = rl.Session(small_cfg(*base, "algo.kl_coef=0.05", "algo.kl_in=reward"))
    assert "old_logprobs_BR" in kl_reward.prepare(kl_reward.score(kl_reward.rollout()))  # needed by the rewards
    kl_reward.close()


def test_the_update_measures_the_reference_kl_as_prepare_would(small_cfg):
    """After a step the policy has left the reference: kl/ref and the controller's KL measured inside the
    update's forward (reused log-probs) equal prepare()'s from its separate forward (the same weights; fp32
    sums in another order: 1e-4 relative, as above)."""
    from rlbench_nb.algos import masked_mean, reference_kl
    from rlbench_nb.data.batch import trained_tokens
    with rl.Session(small_cfg("run.tensorboard=false", "algo.kl_coef=0.05", "train.lr=1e-2",
                              "algo.reuse_logprobs=false")) as sess:
        sess.step()
        batch = sess.prepare(sess.score(sess.rollout()))
        policy = sess.groups["policy"].workers[0]
        trained = trained_tokens(batch).float()
        kl_BR, current = reference_kl(batch["old_logprobs_BR"], batch["ref_logprobs_BR"], trained, "k3")
        assert current > 1e-6  # the policy moved: a KL to measure
        reused = Batch({k: v for k, v in batch.tensors.items() if k != "old_logprobs_BR"}, batch.meta)
        counts = {"num_tokens": trained.sum(), "num_seqs": torch.tensor(float(len(batch)))}
        _, stats = policy._loss(reused, counts, kl_coef=0.05)
    assert stats["kl/ref"] == pytest.approx(masked_mean(kl_BR, trained).item(), rel=1e-4)
    assert stats["kl_current"] == pytest.approx(current, rel=1e-4)


def test_bfloat16_keeps_fp32_masters_and_syncs_a_bf16_rollout_copy(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false", "model.dtype=bfloat16", "train.lr=1e-2",
                                "algo.reuse_logprobs=false"))  # prepare() runs the trainer's (bf16) forward
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
    diff = (batch["rollout_logprobs_BR"][m] - batch["old_logprobs_BR"][m]).abs()
    # bf16 keeps 8 bits of mantissa (2^-9 relative per rounding): through 4 layers the log-probs differ by ~0.01 on
    # average (0.011 / 0.011 / 0.014 with model.attention auto / sdpa / eager here) and by up to ~0.3-0.7 on the
    # odd token; a stale or mis-cast copy differs by far more
    assert 0 < diff.mean() < 0.05 and diff.max() < 1.5
    sess.close()


def test_shared_prompt_prefix_gives_the_same_logprobs_gradients_and_update(small_cfg):
    """Each distinct prompt runs once and its KV cache serves its rollout.n responses: the same numbers as
    whole sequences, with the gradient reaching the prompt positions through the cache."""
    base = ["run.tensorboard=false", "algo.kl_coef=0.05", "algo.entropy_coef=0.01", "train.lr=1e-2",
            "train.pack_sequences=false"]  # packed rows replace the shared prefix where they run
    ref_row, ref_g = _step(small_cfg(*base, "train.share_prompt_prefix=false"))
    row, g = _step(small_cfg(*base))
    _assert_rows_close(row, ref_row)
    _assert_grads_close(g, ref_g)

    sess = rl.Session(small_cfg("run.tensorboard=false", "train.pack_sequences=false"))
    policy = sess.groups["policy"].workers[0]
    batch = sess.score(sess.rollout())
    mask = batch["response_mask_BR"].bool()
    rows_seen = []
    hook = policy.model.get_input_embeddings().register_forward_hook(
        lambda m, i, o: rows_seen.append(tuple(i[0].shape)))
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
    _assert_grads_close(out[True][2], out[False][2])
    assert out[False][2]["model.embed_tokens.weight"].norm() > 0  # the prompt's embeddings got gradient
    sess.close()


def test_a_sequence_mis_rejects_leaves_the_loss_and_its_denominators(small_cfg):
    """algo.rollout_is=mis: a rejected sequence (weight 0) takes no part in the loss, its entropy bonus, its KL or
    its token and sequence counts, as verl's rejection mask: the loss equals the loss of the kept rows alone (with
    them kept in the denominators, half the batch rejected halved every other sequence's share)."""
    from rlbench_nb.roles.trainer import loss_counts
    for agg in ("token-mean", "seq-mean-token-mean"):
        sess = rl.Session(small_cfg("run.tensorboard=false", "algo.rollout_is=mis", "algo.entropy_coef=0.01",
                                    "algo.kl_coef=0.05", f"algo.loss_agg={agg}"))
        policy = sess.groups["policy"].workers[0]
        batch = sess.prepare(sess.score(sess.rollout()))
        weights = batch["response_mask_BR"].float().clone()
        weights[: len(batch) // 2] = 0.0  # the first half rejected
        rejected = batch.replace(is_weights_BR=weights)
        kept = batch.slice(len(batch) // 2, len(batch))
        kept = kept.replace(is_weights_BR=kept["response_mask_BR"].float())
        loss_rej, stats_rej = policy._loss(rejected, loss_counts(rejected), 0.05)
        loss_kept, stats_kept = policy._loss(kept, loss_counts(kept), 0.05)
        assert loss_counts(rejected)["num_seqs"] == loss_counts(kept)["num_seqs"] == len(batch) // 2
        torch.testing.assert_close(loss_rej, loss_kept, rtol=1e-5, atol=1e-7)  # the same rows' sums, fp32
        for key in ("loss/policy", "entropy", "loss/kl"):
            assert stats_rej[key] == pytest.approx(stats_kept[key], rel=1e-5, abs=1e-7), (agg, key)
        sess.close()


def test_the_critics_activation_checkpointing_recomputes_its_layers(small_cfg):
    """train.activation_checkpointing on the critic: each layer's forward runs again in the backward (it never
    did: from_pretrained left the backbone in eval mode, where transformers keeps every activation), and the
    update is the same as without."""
    grads, calls = {}, {}
    for ckpt in (False, True):
        sess = rl.Session(small_cfg("run.tensorboard=false", "algo.advantage=gae", "train.lr=1e-2",
                                    f"train.activation_checkpointing={str(ckpt).lower()}"))
        critic = sess.groups["critic"].workers[0]
        batch = sess.prepare(sess.score(sess.rollout()))
        calls[ckpt] = 0

        def count(*_, ckpt=ckpt):
            calls[ckpt] += 1
        # a pre-hook: the recompute stops once it has what the backward needs (torch's early stop), before the end
        hook = critic.model.backbone.layers[0].register_forward_pre_hook(count)
        sess.update(batch)
        hook.remove()
        beta1 = critic.optimizer.param_groups[0]["betas"][0]
        grads[ckpt] = {n: critic.optimizer.state[p]["exp_avg"] / (1 - beta1)
                       for n, p in critic.model.named_parameters()}
        sess.close()
    assert calls[True] == 2 * calls[False] > 0
    _assert_grads_close(grads[True], grads[False])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_trained_model_keeps_no_dropout_so_its_no_grad_passes_repeat(small_cfg, tmp_path, arch):
    """A model whose config has dropout (GPT-2's dropout modules; Llama's attention_dropout, a number its attention
    reads): the policy stays in training mode, and its log-probs were dropout noise, unlike the engine's and unlike
    themselves. Now twice the same, and the same as in eval mode; the critic's likewise holds no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from rlbench_nb.roles.policy import PolicyWorker
    torch.manual_seed(0)
    model = (GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                        resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)) if arch == "gpt2" else
             LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.3)))
    model.save_pretrained(tmp_path / arch)
    cfg = small_cfg("model.attention=eager")  # eager: the attention path that applies attention_dropout
    policy = PolicyWorker(cfg, str(tmp_path / arch))
    assert policy.model.training
    g = torch.Generator().manual_seed(1)
    batch = Batch({"prompt_ids_BP": torch.randint(1, 64, (4, 6), generator=g), "prompt_mask_BP": torch.ones(4, 6),
                   "response_ids_BR": torch.randint(1, 64, (4, 5), generator=g), "response_mask_BR": torch.ones(4, 5)})
    first, again = (policy.compute_logprobs(batch)["old_logprobs_BR"] for _ in range(2))
    policy.model.eval()
    evaluated = policy.compute_logprobs(batch)["old_logprobs_BR"]
    assert torch.equal(first, again) and torch.equal(first, evaluated)
    from rlbench_nb.roles.critic import CriticWorker
    critic = CriticWorker(cfg, str(tmp_path / arch)).model  # its values in prepare and the update: no dropout either
    assert critic.training and not [m for m in critic.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    assert not [n for m in critic.modules() for n, v in vars(m).items() if "dropout" in n and v not in (0.0, None)
                and isinstance(v, float)]
