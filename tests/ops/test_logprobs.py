"""Chunked token log-probs / entropy (rlbench_nb/ops): values and gradients against the naive full-logits
computation and a hand-worked case; the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.testing import assert_close

from rlbench_nb.ops import naive_logprobs_entropy, token_logprobs_entropy, triton_rows


def _inputs(N=37, H=16, V=1000, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, dtype=dtype, generator=g).requires_grad_()
    W = torch.randn(V, H, dtype=dtype, generator=g).requires_grad_()
    ids = torch.randint(0, V, (N,), generator=g)
    return h, W, ids


def test_hand_worked_two_token_vocabulary():
    # hidden [1], W rows [0] and [ln 3]: logits (0, ln 3) -> p = (1/4, 3/4)
    h = torch.tensor([[1.0]], dtype=torch.float64)
    W = torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64)
    lp, ent = token_logprobs_entropy(h, W, torch.tensor([1]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-12)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-12)
    # temperature 2: logits (0, ln 3 / 2) -> p = (1, sqrt 3) / (1 + sqrt 3)
    lp, _ = token_logprobs_entropy(h, W, torch.tensor([0]), temperature=2.0)
    assert lp.item() == pytest.approx(-math.log(1 + math.sqrt(3)), abs=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_values_and_gradients(chunk_size, temperature):
    h, W, ids = _inputs()
    lp, ent = token_logprobs_entropy(h, W, ids, temperature, chunk_size=chunk_size)
    lp_ref, ent_ref = naive_logprobs_entropy(h, W, ids, temperature)
    assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    g_lp, g_ent = torch.randn(len(ids), dtype=h.dtype), torch.randn(len(ids), dtype=h.dtype)
    got = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, W))
    want = torch.autograd.grad((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum(), (h, W))
    for a, b in zip(got, want):
        assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradcheck():
    h, W, ids = _inputs(N=5, H=3, V=11)
    assert torch.autograd.gradcheck(lambda h, W: token_logprobs_entropy(h, W, ids, 0.9, chunk_size=2), (h, W))


def test_only_logprob_used_gives_the_logprob_gradient():
    # entropy unused -> its incoming gradient is None: d(sum lp)/dh must still match
    h, W, ids = _inputs()
    lp, _ = token_logprobs_entropy(h, W, ids, chunk_size=10)
    got = torch.autograd.grad(lp.sum(), h)[0]
    want = torch.autograd.grad(naive_logprobs_entropy(h, W, ids)[0].sum(), h)[0]
    assert_close(got, want)


def test_bfloat16_compute_stays_close_to_fp32():
    h, W, ids = _inputs(dtype=torch.float32)
    lp, ent = token_logprobs_entropy(h.bfloat16(), W.bfloat16(), ids, chunk_size=16)
    assert lp.dtype == torch.float32  # reductions in fp32 whatever the compute dtype
    lp_ref, ent_ref = naive_logprobs_entropy(h, W, ids)
    assert (lp - lp_ref).abs().max() < 0.5 and (ent - ent_ref).abs().max() < 0.1


def test_bad_arguments_are_named():
    h, W, ids = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_entropy(h, W, ids, temperature=0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_entropy(h, W, ids, chunk_size=0)


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from rlbench_nb.ops import triton_rows
    from rlbench_nb.ops.logprobs import _rows_backward_torch, _rows_forward_torch
    torch.manual_seed(0)
    n, V, T = 6, 9001, 0.7          # V not a multiple of the block: the masked tail is exercised
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        logits = (torch.randn(n, V) * 3).to(dtype)
        ids = torch.randint(0, V, (n,))
        outs = [torch.empty(n) for _ in range(4)]
        triton_rows.forward(logits, ids, 1 / T, *outs)
        ref = _rows_forward_torch(logits.float() / T, ids)
        for a, b in zip(outs, ref):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        g_lp, g_ent = torch.randn(n), torch.randn(n)
        want = _rows_backward_torch(logits.float() / T, ids, ref[2], ref[3], g_lp, g_ent) / T
        buf = logits.clone()
        triton_rows.backward(buf, ids, 1 / T, ref[2], ref[3], g_lp, g_ent)
        torch.testing.assert_close(buf.float(), want.to(dtype).float(),
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)
    print("TRITON_OK")
""")


@pytest.mark.skipif(not triton_rows.available(), reason="triton not installed (it comes with the [vllm] extra)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled kernels are tested instead "
                    "(and Triton 3.6's interpreter cannot run them; 3.9's can)")
def test_triton_kernels_match_torch_rows_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert "TRITON_OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_path_matches_naive(dtype):
    h, W, ids = _inputs(N=300, H=64, V=32000, dtype=torch.float32)
    h, W, ids = (h.detach().cuda().to(dtype).requires_grad_(), W.detach().cuda().to(dtype).requires_grad_(), ids.cuda())
    lp, ent = token_logprobs_entropy(h, W, ids, 0.8, chunk_size=128)
    lp_ref, ent_ref = naive_logprobs_entropy(h, W, ids, 0.8)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert_close(lp, lp_ref, rtol=tol, atol=tol)
    assert_close(ent, ent_ref, rtol=tol, atol=tol)
    g = torch.randn_like(lp)
    got = torch.autograd.grad((lp * g).sum() + ent.sum(), (h, W))
    want = torch.autograd.grad((lp_ref * g).sum() + ent_ref.sum(), (h, W))
    for a, b in zip(got, want):
        assert_close(a.float(), b.float(), rtol=tol * 5, atol=tol * 5)
