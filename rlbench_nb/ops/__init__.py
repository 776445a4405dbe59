"""Numerical ops: chunked token log-probs and entropy (Triton on CUDA, torch elsewhere); CPU attention."""
from .logprobs import chunk_tokens, naive_logprobs_entropy, token_logprobs_entropy

__all__ = ["chunk_tokens", "naive_logprobs_entropy", "token_logprobs_entropy"]
