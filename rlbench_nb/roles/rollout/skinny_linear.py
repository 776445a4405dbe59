"""Linear layers for decode-sized batches on a CPU: y = (W @ x^T)^T instead of x @ W^T.

A decode step multiplies a few rows (the sequences still generating) by every weight of the model. `F.linear`
asks the BLAS for x[M,K] @ W[N,K]^T, and for a small M the BLAS repacks the large transposed operand, the
weight, on every call: the step pays a copy of the whole model. Asked as W[N,K] @ x^T, the operand it packs is
the few rows. On the 2-core EPYC at SmolLM2-135M's shapes, 30 layers' projections at 16 rows took 47-78 ms
this way against 57-92 ms (the same weights, alternating runs), 4 rows 27 ms against 59, and the 49152 x 576
output layer 15.5 ms against 23.

Only the engine's own model takes it (`use_skinny_linears`), only without autograd, only at up to
`MAX_ROWS` rows (a prefill's hundreds of rows gain nothing), and only on a CPU: a GPU's BLAS has no such cost.
The result equals `F.linear`'s to rounding (the sums run in another order).
"""
from __future__ import annotations

import types

import torch

MAX_ROWS = 64  # at 64 rows both forms took the same time here; above it F.linear's blocking wins
# The BLAS's fast kernels take the rows 16 at a time: 13-15 rows took 580-680 us on a 1536 x 576 weight against
# 240 at 16, so rows are padded with zeros to the next multiple of 16 (a few KB) once past a handful
PAD_TO, PAD_FROM = 16, 5
# a weight that sits in the CPU's cache costs little to repack, and the extra small ops of this form cost more
# than they save: the built-in task's 0.7M model (128 x 256 weights) decoded 10% slower with them; SmolLM2's
# smallest (576 x 192, its K and V projections) still gain
MIN_WEIGHT = 2 ** 16


def takes_columns(rows: int) -> bool:
    """Whether a skinny linear computes `rows` rows as W @ x^T now (else F.linear: autograd, or too many rows)."""
    return 0 < rows <= MAX_ROWS and not torch.is_grad_enabled()


def columns(x: torch.Tensor) -> torch.Tensor:
    """W @ x^T's right operand for x's [rows, in] rows: zero rows padded to a multiple of PAD_TO from PAD_FROM rows
    on, transposed (a view where nothing is padded). One input's operand serves every linear that reads it."""
    rows = x.shape[0]
    pad = PAD_TO - rows % PAD_TO if rows >= PAD_FROM and rows % PAD_TO else 0
    return (torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x).t()


def times_columns(linear: torch.nn.Linear, cols: torch.Tensor, rows: int) -> torch.Tensor:
    """linear(x) [rows, out] from `columns(x)`: W @ x^T, the padding's columns dropped, transposed, bias added."""
    y = torch.mm(linear.weight, cols)
    y = (y if y.shape[1] == rows else y[:, :rows]).t()
    return y if linear.bias is None else y + linear.bias


def skinny_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not takes_columns(rows):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    y = times_columns(self, columns(x.reshape(rows, x.shape[-1])), rows)
    return y.reshape(*x.shape[:-1], self.weight.shape[0])


def is_skinny(linear: torch.nn.Module) -> bool:
    """Whether `use_skinny_linears` gave `linear` the skinny forward."""
    return getattr(linear.forward, "__func__", None) is skinny_forward


def use_skinny_linears(model: torch.nn.Module, min_weight: int = MIN_WEIGHT) -> int:
    """Give each plain fp32 `nn.Linear` of `model` with at least `min_weight` weights the skinny forward; how many
    got it. Subclasses (quantized, LoRA wrappers) keep their own forward; the plain layers they wrap get this one.
    bf16 layers (rollout.dtype) keep F.linear: oneDNN's bf16 kernels do not repack the weight, and W @ x^T was
    as fast or slower at SmolLM2's shapes (16 rows: 91-103 us against 109-113; 4 rows: 92-106 against 69-75)."""
    patched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32 \
                and module.weight.device.type == "cpu" and module.weight.numel() >= min_weight:
            module.forward = types.MethodType(skinny_forward, module)
            patched += 1
    return patched
