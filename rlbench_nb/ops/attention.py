"""Attention for `transformers` models on a CPU: plain matmul-softmax-matmul for small calls, SDPA for big ones.

    model = load_model(AutoModelForCausalLM, path, cfg.model.attention, device, dtype=torch.float32)

torch's CPU SDPA kernel (flash attention for CPU) pays a fixed cost per call that dwarfs the work of a small
one: on a 2-core EPYC, 0.57 ms for a [64 rows, 4 heads, 8 queries, 18 keys, head 32] no-grad call that the
three plain ops do in 0.17 ms. RL on a CPU is made of such calls (a few dozen tokens per sequence, one query per
decode step, the responses attending to a shared prompt's cache): at the built-in task's size the plain path
takes a whole GRPO step from 57 to 50 ms, and at 20M parameters the two are even (benchmarks/attention.py). For
big calls SDPA wins (2x in the forward from ~10^7 scores on, and it never holds the [B, H, Lq, Lk] scores), so
`SMALL_SCORES` (the score tensor's element count) splits the two. It replaces SDPA only where `transformers`
chose SDPA for the model: a model it runs otherwise keeps that, and on an accelerator nothing changes.

Both paths take the boolean masks `transformers` builds for SDPA (`sdpa_mask`: True = attend; or None when the
call is plainly causal), so a model switches between them call by call with no other change. Masked scores get
the dtype's lowest value, as `transformers`' eager attention does: a query with no key to see (a left-padding
position, never read) gets the mean of the values where SDPA gives zeros.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

NAME = "rlbench_cpu"
# at most this many scores (B x H x Lq x Lk: 4 MB in fp32) a call takes the plain path: whole steps are faster at
# the tiny size and even at 20M (benchmarks/README.md, "Attention on a CPU"); a forward's crossover in isolation
# is ~2-10 x 10^6 scores on a 2-core EPYC (AVX-512)
SMALL_SCORES = 1 << 20


def small_or_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """A `transformers` attention function (AttentionInterface): [B, H, Lq, D] queries -> [B, Lq, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, H, Lq, _ = query.shape
    if B * H * Lq * key.shape[2] > SMALL_SCORES or kwargs.get("position_bias") is not None:
        # (a learned position bias, as T5's: SDPA's own handling of it, not a second copy here)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if query.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(query.device.type):
        # in fp32, as SDPA's kernel accumulates: bf16 scores would round each logit of the softmax to 3 digits
        with torch.autocast(query.device.type, enabled=False):
            out = _plain(module, query.float(), key.float(), value.float(), attention_mask, scale, dropout, causal)
        return out.to(query.dtype), None
    return _plain(module, query, key, value, attention_mask, scale, dropout, causal), None


def _plain(module, query, key, value, attention_mask, scale: float, dropout: float, causal: bool) -> torch.Tensor:
    B, H, Lq, D = query.shape
    KVH, Lk = key.shape[1], key.shape[2]
    G = H // KVH
    # grouped-query attention without repeating the cache: the G query heads of a KV head (heads kv*G .. kv*G+G-1,
    # as transformers' repeat_kv orders them) become G x Lq query rows of that head. repeat_kv copied every layer's
    # whole K and V cache on every call: 39% of a decode step of SmolLM2-135M (9 heads on 3) at 16 rows x 290 keys
    q = query.reshape(B, KVH, G * Lq, D)
    scores = torch.matmul(q, key.transpose(2, 3)).mul_(scale).view(B, KVH, G, Lq, Lk)
    if attention_mask is None and Lq > 1 and causal:
        # sdpa_mask leaves a call unmasked when it is plainly causal with as many queries as keys: SDPA's is_causal,
        # whose mask this is (query i sees keys 0..i, for any shape)
        attention_mask = torch.ones(Lq, Lk, dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None:
        # [b, 1 or H, Lq, Lk] (or [Lq, Lk]) -> broadcastable to the scores' [B, KVH, G, Lq, Lk]
        mask = attention_mask if attention_mask.dim() == 4 else attention_mask[None, None]
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], KVH, G, Lq, Lk)
        if mask.dtype == torch.bool:  # in place: the scores are this call's own, and autograd keeps only the mask
            scores = scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:  # an additive float mask
            scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1).view(B, KVH, G * Lq, Lk)
    if dropout > 0 and module.training:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, value).view(B, H, Lq, D).transpose(1, 2).contiguous()


def register() -> None:
    """Make NAME an attention implementation `from_pretrained` accepts, with SDPA's masks (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, small_or_sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def load_model(cls, path: str, attention: str, device: torch.device, **kwargs):
    """`cls.from_pretrained(path, **kwargs)` with `model.attention`: a named implementation is asked for as it is
    (sdpa, eager, flash_attention_2, ...); `auto` lets transformers choose, then on a CPU puts NAME where it chose
    SDPA (the same math, call by call). A model transformers runs otherwise (one without SDPA support, e.g.
    attention sinks) keeps its choice, as does a composite model."""
    chosen = {} if attention == "auto" else {"attn_implementation": attention}
    with no_progress_bars():
        model = cls.from_pretrained(path, **kwargs, **chosen)
    # not a composite model (sub-configs: a vision tower, an encoder...): switching it would switch sub-models
    # transformers put on other implementations too
    if (attention == "auto" and device.type == "cpu" and model.config._attn_implementation == "sdpa"
            and not getattr(model.config, "sub_configs", None) and model._can_set_attn_implementation()):
        register()
        model.set_attn_implementation(NAME)
    return model


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' bars ("Loading weights 100% 39/39") off while rlbench-nb loads a model: every role's load
    would print one into the notebook's output (Ray forwards the actors' stderr there too). Restored after, so a
    load of your own still shows its bar."""
    from transformers.utils import logging
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()
