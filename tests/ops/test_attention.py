"""CPU attention (rlbench_nb/ops/attention.py): the plain path against a hand-worked case and against
transformers' SDPA attention (values and gradients, every mask form a model hands it), the switch to SDPA for
big calls, and whole models loaded both ways."""
from __future__ import annotations

import math
import types

import pytest
import torch
from torch.testing import assert_close
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlbench_nb.ops import attention

MODULE = types.SimpleNamespace(num_key_value_groups=1, is_causal=True, training=False)


def test_hand_worked_one_query_two_keys():
    # scores (0, ln 3) -> softmax (1/4, 3/4) -> 1/4 * 4 + 3/4 * 8 = 7; with key 1 masked: 4
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64).view(1, 1, 2, 1)
    v = torch.tensor([4.0, 8.0], dtype=torch.float64).view(1, 1, 2, 1)
    out, _ = attention.small_or_sdpa_attention(MODULE, q, k, v, None, scaling=1.0)
    assert out.shape == (1, 1, 1, 1) and out.item() == pytest.approx(7.0, abs=1e-12)
    hide = torch.tensor([True, False]).view(1, 1, 1, 2)
    out, _ = attention.small_or_sdpa_attention(MODULE, q, k, v, hide, scaling=1.0)
    assert out.item() == pytest.approx(4.0, abs=1e-12)


def _inputs(B, H, Lq, Lk, D, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = kv_heads or H
    return [torch.randn(B, h, L, D, dtype=torch.float64, generator=g).requires_grad_()
            for h, L in ((H, Lq), (kv, Lk), (kv, Lk))]


def _left_padded_mask(B, Lq, Lk, pads):
    """sdpa_mask's form: bool [B, 1, Lq, Lk], causal with the last query at the last key, row b's first pads[b]
    keys padding."""
    causal = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    keys = torch.arange(Lk)[None, :] >= torch.tensor(pads)[:, None]
    return (causal[None] & keys[:, None, :])[:, None]


CASES = {  # name: (B, H, Lq, Lk, kv heads, mask maker)
    "prefill, left padding": (3, 2, 6, 6, None, lambda: _left_padded_mask(3, 6, 6, [0, 2, 1])),
    "decode step, left padding": (3, 2, 1, 7, None, lambda: _left_padded_mask(3, 1, 7, [0, 2, 1])),
    "responses on a prompt's cache": (4, 2, 3, 8, None, lambda: _left_padded_mask(4, 3, 8, [1, 0, 0, 2])),
    "plainly causal (no mask)": (2, 2, 5, 5, None, lambda: None),
    "grouped-query heads": (2, 4, 5, 5, 2, lambda: _left_padded_mask(2, 5, 5, [0, 1])),
    # (the plain path never repeats K and V: it folds each KV head's query heads into rows; SmolLM2's 9 on 3)
    "grouped-query decode step, left padding": (3, 6, 1, 7, 2, lambda: _left_padded_mask(3, 1, 7, [0, 2, 1])),
    "grouped-query responses on a cache": (4, 9, 3, 8, 3, lambda: _left_padded_mask(4, 3, 8, [1, 0, 0, 2])),
    "grouped-query, plainly causal (no mask)": (2, 4, 5, 5, 1, lambda: None),
    "an additive float mask": (3, 2, 6, 6, None, lambda: torch.zeros(3, 1, 6, 6, dtype=torch.float64).masked_fill(
        ~_left_padded_mask(3, 6, 6, [0, 2, 1]), torch.finfo(torch.float64).min)),
    "bidirectional (an encoder's layer), no mask": (2, 2, 5, 5, None, lambda: None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plain_path_matches_sdpa_values_and_gradients(case):
    B, H, Lq, Lk, kv, make_mask = CASES[case]
    module = types.SimpleNamespace(num_key_value_groups=H // (kv or H), is_causal="bidirectional" not in case,
                                   training=False)
    mask = make_mask()
    ours_in, sdpa_in = _inputs(B, H, Lq, Lk, 8, kv), _inputs(B, H, Lq, Lk, 8, kv)
    ours, _ = attention.small_or_sdpa_attention(module, *ours_in, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, *sdpa_in, mask, scaling=0.3)
    # a query with no key to see (a left-padded position) gets zeros from SDPA and the values' mean here; both are
    # padding a model never reads, so the comparison is over the queries that see something
    visible = None if mask is None else mask > torch.finfo(mask.dtype).min if mask.is_floating_point() else mask
    seen = torch.ones(B, Lq, dtype=torch.bool) if mask is None else visible[:, 0].any(-1)
    assert torch.isfinite(ours).all()
    # float64 on both sides: the two differ only in the order of their sums (~1e-15)
    assert_close(ours[seen], ref[seen], atol=1e-10, rtol=1e-10)
    grad = torch.randn(ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad = grad * seen[:, :, None, None]
    (ours * grad).sum().backward()
    (ref.nan_to_num() * grad).sum().backward()
    for a, b in zip(ours_in, sdpa_in):
        assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_is_computed_in_fp32_and_rounded_once(autocast):
    """bf16 queries, keys and values (a bf16 rollout copy; a trainer under autocast): the scores and the softmax are
    fp32, as in SDPA's kernel, so the only error left is the output's own rounding to bf16 (half an ulp: 2^-9
    relative). Scores rounded to bf16 miss that bound on logits of this size."""
    q, k, v = (t.detach() * 3 for t in _inputs(4, 2, 6, 6, 16))
    mask = _left_padded_mask(4, 6, 6, [0, 2, 1, 0])
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    exact, _ = attention.small_or_sdpa_attention(MODULE, *(t.double() for t in low), mask, scaling=0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours, _ = attention.small_or_sdpa_attention(MODULE, *low, mask, scaling=0.25)
    assert ours.dtype == torch.bfloat16
    seen = mask[:, 0].any(-1)
    err = (ours.double() - exact)[seen].abs()
    assert (err <= exact[seen].abs() * 2.0 ** -8 + 1e-30).all()


def test_a_big_call_goes_to_sdpa_itself(monkeypatch):
    from transformers.integrations import sdpa_attention
    calls = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                        lambda *a, **kw: calls.append(a[1].shape) or sdpa_attention_forward(*a, **kw))
    B, H, Lq, Lk = 2, 2, 5, 5
    q, k, v = (t.detach().float() for t in _inputs(B, H, Lq, Lk, 8))
    mask = _left_padded_mask(B, Lq, Lk, [0, 1])
    ref, _ = sdpa_attention_forward(MODULE, q, k, v, mask, scaling=0.3)
    monkeypatch.setattr(attention, "SMALL_SCORES", B * H * Lq * Lk)  # the limit itself is still small
    small, _ = attention.small_or_sdpa_attention(MODULE, q, k, v, mask, scaling=0.3)
    assert calls == []
    monkeypatch.setattr(attention, "SMALL_SCORES", B * H * Lq * Lk - 1)  # this call is now big
    big, _ = attention.small_or_sdpa_attention(MODULE, q, k, v, mask, scaling=0.3)
    assert calls == [q.shape] and torch.equal(big, ref)
    monkeypatch.setattr(attention, "SMALL_SCORES", B * H * Lq * Lk)
    bias = torch.randn(1, H, Lq, Lk)  # a learned position bias (T5's): SDPA's own handling, whatever the size
    attention.small_or_sdpa_attention(MODULE, q, k, v, mask, scaling=0.3, position_bias=bias)
    assert calls == [q.shape, q.shape]
    # fp32 logits-sized values; the two sum in different orders (~1e-7)
    assert_close(small[1, 1:], ref[1, 1:], atol=1e-6, rtol=1e-6)


def _llama(path, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **overrides)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def test_model_attention_setting_chooses_the_implementation(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    path = _llama(tmp_path)
    chosen = lambda setting, device: attention.load_model(  # noqa: E731
        AutoModelForCausalLM, path, setting, torch.device(device)).config._attn_implementation
    assert chosen("auto", "cpu") == attention.NAME
    assert chosen("auto", "cuda") == "sdpa"  # elsewhere transformers' own choice (loaded on the CPU all the same)
    assert chosen("eager", "cpu") == "eager" and chosen("sdpa", "cpu") == "sdpa"
    # a model transformers does not run with SDPA (attention sinks, soft-capping kernels...) keeps its own choice
    monkeypatch.setattr(LlamaForCausalLM, "_supports_sdpa", False)
    assert chosen("auto", "cpu") == "eager"


def test_loading_a_model_prints_no_progress_bar_and_leaves_the_switch_as_it_was(tmp_path, capfd):
    """Every role's load would put transformers' "Loading weights" bar into the notebook's output."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    path = _llama(tmp_path)
    was = logging.is_progress_bar_enabled()  # the suite's conftest turns them off
    logging.enable_progress_bar()
    try:
        capfd.readouterr()
        attention.load_model(AutoModelForCausalLM, path, "auto", torch.device("cpu"))
        assert "Loading weights" not in capfd.readouterr().err and logging.is_progress_bar_enabled()
        AutoModelForCausalLM.from_pretrained(path)  # a load of your own still shows it: the test can fail
        assert "Loading weights" in capfd.readouterr().err
    finally:
        if not was:
            logging.disable_progress_bar()


def test_a_model_gives_the_same_logits_and_cache_either_way(tmp_path):
    """A real Llama (grouped-query heads) loaded with the auto setting and with SDPA: left-padded prefill, a decode
    step on the KV cache, and packed rows (restarting positions, no mask) give the same logits."""
    from transformers import AutoModelForCausalLM, DynamicCache
    path = _llama(tmp_path)
    ours = attention.load_model(AutoModelForCausalLM, path, "auto", torch.device("cpu"))
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    assert ours.config._attn_implementation == attention.NAME
    ids = torch.randint(3, 50, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    nxt = torch.tensor([[7], [8], [9]])
    logits = []
    for model in (ours, sdpa):
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            first = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits
            step = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                         position_ids=pos[:, -1:] + 1, past_key_values=cache).logits
            # packed rows: restarting positions and no cache (roles/packing.py), so transformers masks each
            # sequence off from the others; the same logits as each sequence alone
            packed = model(input_ids=ids.view(1, -1), position_ids=torch.arange(6).repeat(3)[None],
                           use_cache=False).logits.view(3, 6, -1)
            alone = model(input_ids=ids, use_cache=False).logits
            assert_close(packed, alone, atol=1e-5, rtol=1e-5)
        logits.append((first[mask.bool()], step, packed))
    # fp32 on both sides, logits of size ~1: different sum orders differ by ~1e-7
    for a, b in zip(*logits):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
