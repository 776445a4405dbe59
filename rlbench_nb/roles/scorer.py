"""The module the policy and reference workers run: a causal LM plus the chunked log-prob/entropy head.

    scorer = TokenScorer(lm, chunk_mb=256, temperature=1.0, compute_dtype=torch.bfloat16, autocast=True)
    lp_BR, ent_BR = scorer(ids, mask, pos, response_ids_BR, start=P - 1)

It is the root FSDP2 unit (decoder layers are units of their own), so the embedding, final norm and
LM head are gathered inside its forward and the head weight can be used directly by the chunked op:
full [B, T, V] logits are never built. `chunk_size=0` falls back to the model's own forward (full
logits), which is also what models with logit soft-capping or scaling use. `chunk_mb` bounds one
chunk's fp32 logits: at V=152k, 256 MiB is ~440 tokens; at the built-in task's V=18 everything is one chunk.
"""
from __future__ import annotations

import torch
from torch import nn

from ..algos import entropy_from_logits
from ..ops import chunk_tokens, token_logprobs_entropy
from .common import token_logprobs


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

    def forward(self, input_ids, attention_mask, position_ids, response_ids_BR, start: int,
                with_entropy: bool = True):
        """Log-probs [B, R] of `response_ids_BR` predicted from positions start..start+R-1, and the entropy
        there ([B, R], or None)."""
        B, R = response_ids_BR.shape
        with torch.autocast(input_ids.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            if self.chunk_size == 0:
                logits = self.lm(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids).logits[:, start:start + R].float() / self.temperature
                lp = token_logprobs(logits, response_ids_BR)
                return lp, (entropy_from_logits(logits) if with_entropy else None)
            hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                           position_ids=position_ids).last_hidden_state
        h = hidden[:, start:start + R].reshape(B * R, -1).to(self.compute_dtype)
        lp, ent = token_logprobs_entropy(h, self.lm.get_output_embeddings().weight, response_ids_BR.reshape(-1),
                                         self.temperature, self.chunk_size)
        # fresh tensors, not views: FSDP2 hooks the root's outputs for backward, and a view could lose that
        return lp.view(B, R).clone(), (ent.view(B, R).clone() if with_entropy else None)
