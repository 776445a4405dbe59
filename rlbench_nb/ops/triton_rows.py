"""Triton kernels for the row-wise half of `logprobs.py`: one program per token row of a logits chunk.

forward:  one pass over the vocabulary with an online logsumexp that also carries sum(exp(z - m) * z),
          so log p[y], the entropy, lse and E_p[z] come out of a single read of the row.
backward: one more pass that overwrites the logits row with dL/d(logits) (scaled by 1/T), so the
          gradient needs no buffer of its own.

Reads any float dtype, computes in fp32. Triton is imported lazily: CPU installs run without it, and
with TRITON_INTERPRET=1 the same kernels run on CPU tensors (that is how CI tests them).
"""
from __future__ import annotations

import functools

BLOCK = 4096


@functools.cache
def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(logits_ptr, stride, ids_ptr, inv_t, lp_ptr, ent_ptr, lse_ptr, mz_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        m = float("-inf")  # running max, sum exp(z - m), sum exp(z - m) * z (Python floats: fp32 scalars)
        s = 0.0
        t = 0.0
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            valid = cols < V
            z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(z, 0))
            scale = tl.exp(m - m_new)
            e = tl.exp(z - m_new)
            s = s * scale + tl.sum(e, 0)
            t = t * scale + tl.sum(e * tl.where(valid, z, 0.0), 0)  # e is 0 off the row
            m = m_new
        lse = m + tl.log(s)
        mean_z = t / s
        y = tl.load(ids_ptr + row)
        z_y = tl.load(base + y).to(tl.float32) * inv_t
        tl.store(lp_ptr + row, z_y - lse)
        tl.store(ent_ptr + row, lse - mean_z)
        tl.store(lse_ptr + row, lse)
        tl.store(mz_ptr + row, mean_z)

    @triton.jit
    def bwd(logits_ptr, stride, ids_ptr, inv_t, lse_ptr, mz_ptr, glp_ptr, gent_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        lse = tl.load(lse_ptr + row)
        mean_z = tl.load(mz_ptr + row)
        g_lp = tl.load(glp_ptr + row)
        g_ent = tl.load(gent_ptr + row)
        y = tl.load(ids_ptr + row)
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            valid = cols < V
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            p = tl.exp(z - lse)
            g = -p * (g_lp + g_ent * (z - mean_z))
            g = tl.where(cols == y, g + g_lp, g) * inv_t
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=valid)

    return fwd, bwd


def forward(logits, ids, inv_t: float, lp, ent, lse, mean_z) -> None:
    """logits [n, V] (row-contiguous), ids [n] -> fills the four fp32 [n] outputs."""
    fwd, _ = _kernels()
    n, V = logits.shape
    fwd[(n,)](logits, logits.stride(0), ids, inv_t, lp, ent, lse, mean_z, V, BLOCK=BLOCK)


def backward(logits, ids, inv_t: float, lse, mean_z, g_lp, g_ent) -> None:
    """Overwrites `logits` [n, V] with dL/d(logits) given dL/d(logprob) and dL/d(entropy) per row."""
    _, bwd = _kernels()
    n, V = logits.shape
    bwd[(n,)](logits, logits.stride(0), ids, inv_t, lse, mean_z, g_lp, g_ent, V, BLOCK=BLOCK)
