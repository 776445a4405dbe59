"""Masked reductions shared by the algorithms (verl `verl.utils.torch_functional` semantics)."""
from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `x` where `mask` is 1; 0 where the mask is empty."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1e-8)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries (Bessel-corrected by default, as verl does)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n <= 1:
            return torch.zeros_like(var)
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries; the mean is added back if not shift_mean.
    Computed on x less its first masked entry, so entries that are all equal whiten to exactly 0: a plain fp32
    mean of them rounds, and 1 / sqrt(1e-8) made the residue ~1e-3 (the same sign on every token)."""
    first = mask.flatten().nonzero()
    ref = x.flatten()[first[0, 0]] if len(first) else x.new_zeros(())
    shifted = x - ref
    mean, var = masked_mean(shifted, mask), masked_var(shifted, mask)
    white = (shifted - mean) * torch.rsqrt(var + 1e-8)
    return white if shift_mean else white + mean + ref
