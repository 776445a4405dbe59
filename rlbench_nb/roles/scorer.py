"""The module the policy and reference workers run: a causal LM plus the chunked log-prob/entropy head.

    scorer = TokenScorer(lm, chunk_mb=256, temperature=1.0, compute_dtype=torch.bfloat16, autocast=True)
    lp_BR, ent_BR = scorer(prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR)

It is the root FSDP2 unit (decoder layers are units of their own), so the embedding, final norm and
LM head are gathered inside its forward and the head weight can be used directly by the chunked op:
full [B, T, V] logits are never built. `chunk_size=0` falls back to the model's own forward (full
logits), which is also what models with logit soft-capping or scaling use. `chunk_mb` bounds one
chunk's fp32 logits: at V=152k, 256 MiB is ~440 tokens; at the built-in task's V=18 everything is one chunk.
With `pack` (train.pack_sequences) the decoder runs on padding-free rows instead (roles/packing.py).
"""
from __future__ import annotations

import torch
from torch import nn

from ..algos import entropy_from_logits
from ..ops import chunk_tokens, token_logprobs_entropy
from .common import join_sequences, token_logprobs
from .packing import pack_sequences, packs


def _has_custom_logits(config) -> bool:
    """Models whose logits are not plain `hidden @ W.T` (Gemma 2 soft-capping, Cohere scaling)."""
    return bool(getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None))


class TokenScorer(nn.Module):
    def __init__(self, lm: nn.Module, chunk_mb: float, temperature: float, compute_dtype: torch.dtype,
                 autocast: bool):
        super().__init__()
        self.lm = lm
        vocab = lm.get_output_embeddings().weight.shape[0]
        self.chunk_size = 0 if (chunk_mb == 0 or _has_custom_logits(lm.config)) else chunk_tokens(vocab, chunk_mb)
        self.temperature = temperature if temperature > 0 else 1.0  # score the distribution the rollout sampled from
        self.compute_dtype = compute_dtype
        self.autocast = autocast  # mixed precision without FSDP2: fp32 weights, matmuls in compute_dtype
        self.share_prefix = False  # set by the worker once it knows whether it is sharded (roles/policy.py)
        self.pack: bool | str = False  # train.pack_sequences (true, false, auto): padding-free rows (roles/packing.py)

    def forward(self, prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR, with_entropy: bool = True,
                targets_BR=None):
        """Log-probs [B, R] of the response tokens after their (left-padded) prompts, and the entropy of
        the distribution at each of those positions ([B, R], or None). `targets_BR`: score these tokens at
        the response's positions instead of the response's own next tokens (the Tinker API's datums name their
        targets: roles/tinker_ops.py)."""
        if packs(self.pack, prompt_mask_BP, response_mask_BR):
            return self._packed(prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR, with_entropy,
                                targets_BR)
        scored_BR = response_ids_BR if targets_BR is None else targets_BR
        B, R = response_ids_BR.shape
        with torch.autocast(prompt_ids_BP.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            if self.chunk_size == 0:
                ids, mask, pos = join_sequences(prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR)
                start = prompt_ids_BP.shape[1] - 1
                logits = self.lm(input_ids=ids, attention_mask=mask,
                                 position_ids=pos).logits[:, start:start + R].float() / self.temperature
                lp = token_logprobs(logits, scored_BR)
                return lp, (entropy_from_logits(logits) if with_entropy else None)
            hidden_BRH = self._response_hidden(prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR)
        h = hidden_BRH.reshape(B * R, -1).to(self.compute_dtype)
        lp, ent = token_logprobs_entropy(h, self.lm.get_output_embeddings().weight, scored_BR.reshape(-1),
                                         self.temperature, self.chunk_size)
        # fresh tensors, not views: FSDP2 hooks the root's outputs for backward, and a view could lose that
        return lp.view(B, R).clone(), (ent.view(B, R).clone() if with_entropy else None)

    def _packed(self, prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR, with_entropy: bool,
                targets_BR=None):
        """`forward` on padding-free rows: the same numbers, zero on padding."""
        rows = pack_sequences(prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR)
        ids_K = (response_ids_BR if targets_BR is None else targets_BR)[rows.mask_BR]
        with torch.autocast(prompt_ids_BP.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            if self.chunk_size == 0:
                logits = self.lm(input_ids=rows.ids_NW, position_ids=rows.positions_NW,
                                 use_cache=False).logits[rows.rows_K, rows.cols_K].float() / self.temperature
                lp, ent = token_logprobs(logits, ids_K), (entropy_from_logits(logits) if with_entropy else None)
            else:
                h = self.lm.get_decoder()(input_ids=rows.ids_NW, position_ids=rows.positions_NW,
                                          use_cache=False).last_hidden_state[rows.rows_K, rows.cols_K]
        if self.chunk_size:
            lp, ent = token_logprobs_entropy(h.to(self.compute_dtype), self.lm.get_output_embeddings().weight, ids_K,
                                             self.temperature, self.chunk_size)
        return rows.scatter(lp), (rows.scatter(ent) if with_entropy else None)

    def _response_hidden(self, prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR):
        """Last hidden states at the positions that predict each response token: [B, R, H].

        With `share_prefix`, each distinct prompt runs through the decoder once and its KV cache is repeated
        for its samples (GRPO's n responses per prompt); only the responses run per sample. Same numbers
        as the whole sequences (tested), and the gradient reaches the prompt's computation through the
        cache. Without it (or when no prompt repeats), whole sequences run as one batch."""
        from transformers import DynamicCache
        dec, P, R = self.lm.get_decoder(), prompt_ids_BP.shape[1], response_ids_BR.shape[1]
        distinct, copy_of = torch.unique(torch.cat([prompt_ids_BP, prompt_mask_BP], dim=1), dim=0,
                                         return_inverse=True) if self.share_prefix else (prompt_ids_BP, None)
        if len(distinct) == len(prompt_ids_BP):
            ids, mask, pos = join_sequences(prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR)
            return dec(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[:, P - 1:P - 1 + R]
        ids, mask = distinct[:, :P], distinct[:, P:]
        cache = DynamicCache(config=self.lm.config)
        last_prompt_BH = dec(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             past_key_values=cache, use_cache=True).last_hidden_state[:, -1][copy_of]
        if R == 1:
            return last_prompt_BH[:, None]
        cache.batch_select_indices(copy_of)
        # response tokens 0..R-2 predict tokens 1..R-1; positions continue after each prompt's real tokens
        pos = prompt_mask_BP.sum(-1, keepdim=True) + torch.arange(R - 1, device=prompt_ids_BP.device)
        resp = dec(input_ids=response_ids_BR[:, :-1],
                   attention_mask=torch.cat([prompt_mask_BP, response_mask_BR[:, :-1]], 1),
                   position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state
        return torch.cat([last_prompt_BH[:, None], resp], dim=1)

