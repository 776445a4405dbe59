"""Token log-probs and entropy straight from the last hidden state and the LM head, in chunks of tokens.

    lp_N, ent_N = token_logprobs_entropy(hidden_NH, lm_head_VH, ids_N, temperature=1.0,
                                         chunk_size=chunk_tokens(V, budget_mb=256))

The naive way, `log_softmax(hidden @ W.T)`, holds fp32 logits of every token ([B, T, V] x 4 bytes: 1.2 GB
for 8 x 256 tokens at V=152k) and keeps them for the backward pass. Here only one chunk's logits
[chunk, V] exist at a time, and the backward pass recomputes them chunk by chunk from the hidden states
(the same trade as Liger's fused linear cross-entropy): peak memory drops from O(N V) to O(chunk V) at
the cost of one extra matmul.

The row-wise part (logsumexp, the target's log-prob, the entropy, and their gradient with respect to
the logits) runs as a Triton kernel for CUDA tensors when Triton is installed (`triton_rows.py`) and as
plain torch otherwise; both are tested against the naive computation (values and gradients).

Math, with z = logits / T, p = softmax(z), lse = logsumexp(z):
    log p[y]      = z[y] - lse
    H             = lse - sum_j p_j z_j
    d log p[y]/dz = onehot(y) - p
    dH/dz         = -p * (z - E_p[z])
"""
from __future__ import annotations

import torch

from . import triton_rows


def _rows_forward_torch(z: torch.Tensor, ids: torch.Tensor):
    """z: [n, V] scaled logits (consumed) -> (logprob [n], entropy [n], lse [n], mean_z [n]).
    In place where it can: at most two [n, V] buffers are alive."""
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, ids[:, None]).squeeze(-1) - lse
    p = torch.sub(z, lse[:, None]).exp_()
    mean_z = p.mul_(z).sum(-1)
    return lp, lse - mean_z, lse, mean_z


def _rows_backward_torch(z: torch.Tensor, ids, lse, mean_z, g_lp, g_ent) -> torch.Tensor:
    """dL/dz for one chunk (z is consumed): -p * (g_lp + g_ent (z - E[z])) + g_lp onehot(y)."""
    p = torch.sub(z, lse[:, None]).exp_()
    coef = z.sub_(mean_z[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None])
    grad = p.mul_(coef).neg_()
    grad.scatter_add_(-1, ids[:, None], g_lp[:, None])
    return grad


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_rows.available()


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, ids_N, temperature: float, chunk_size: int):
        N = hidden_NH.shape[0]
        acc = torch.promote_types(hidden_NH.dtype, torch.float32)  # fp32 reductions (fp64 in gradchecks)
        lp = hidden_NH.new_empty(N, dtype=acc)
        ent, lse, mean_z = torch.empty_like(lp), torch.empty_like(lp), torch.empty_like(lp)
        triton = _use_triton(hidden_NH)
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            logits = hidden_NH[s:e] @ weight_VH.T  # [chunk, V] in the compute dtype: the only big buffer
            if triton:
                triton_rows.forward(logits, ids_N[s:e], 1.0 / temperature,
                                    lp[s:e], ent[s:e], lse[s:e], mean_z[s:e])
            else:
                out = _rows_forward_torch(logits.to(acc).div_(temperature), ids_N[s:e])
                for dst, src in zip((lp, ent, lse, mean_z), out):
                    dst[s:e] = src
            del logits
        ctx.save_for_backward(hidden_NH, weight_VH, ids_N, lse, mean_z)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, ids, lse, mean_z = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk_size
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype).contiguous()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.to(lse.dtype).contiguous()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        triton = _use_triton(hidden)
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            logits = hidden[s:e] @ weight.T  # recomputed: nothing of size [N, V] was kept
            if triton:  # writes dL/d(logits) over the logits buffer, scaled by 1/T
                triton_rows.backward(logits, ids[s:e], 1.0 / T, lse[s:e], mean_z[s:e], g_lp[s:e], g_ent[s:e])
                grad_logits = logits
            else:
                grad_z = _rows_backward_torch(logits.to(lse.dtype).div_(T), ids[s:e], lse[s:e], mean_z[s:e],
                                              g_lp[s:e], g_ent[s:e])
                grad_logits = grad_z.div_(T).to(hidden.dtype)
            if need_h:
                grad_h[s:e] = grad_logits @ weight
            if need_w:
                grad_w.addmm_(grad_logits.T.to(grad_w.dtype), hidden[s:e].to(grad_w.dtype))
            del logits, grad_logits
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None


def chunk_tokens(vocab_size: int, budget_mb: float) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about `budget_mb` MiB."""
    return max(1, int(budget_mb * 2**20 // (4 * vocab_size)))


def token_logprobs_entropy(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, ids_N: torch.Tensor,
                           temperature: float = 1.0, chunk_size: int = 1024):
    """Log-prob of `ids_N` and entropy of softmax(hidden @ W.T / T), both [N] fp32 (fp64 for fp64 input),
    differentiable in hidden and weight. Computes in `hidden_NH.dtype` (the weight is cast to it: under FSDP2's
    bf16 policy it already is) with fp32 reductions."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    weight = weight_VH if weight_VH.dtype == hidden_NH.dtype else weight_VH.to(hidden_NH.dtype)
    # autocast off: the compute dtype is chosen above, and backward must use the same one
    with torch.autocast(hidden_NH.device.type, enabled=False):
        return _ChunkedLogprobEntropy.apply(hidden_NH.contiguous(), weight, ids_N.contiguous(),
                                            float(temperature), int(chunk_size))


def naive_logprobs_entropy(hidden_NH, weight_VH, ids_N, temperature: float = 1.0):
    """The reference: full fp32 logits [N, V]. Used by tests and the memory benchmark."""
    acc = torch.promote_types(hidden_NH.dtype, torch.float32)
    logits = (hidden_NH @ weight_VH.to(hidden_NH.dtype).T).to(acc) / temperature
    logp = logits.log_softmax(-1)
    lp = logp.gather(-1, ids_N[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent
