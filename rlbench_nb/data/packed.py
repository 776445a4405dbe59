"""A dict of tensors as one flat byte buffer: how tensors cross process boundaries.

    packed = PackedTensors.pack({"w": torch.randn(3, 4), "b": torch.arange(5).bfloat16()})
    tensors = packed.unpack()      # views of the buffer, any dtype (bfloat16 included), original shapes

One numpy buffer plus an index of (name, dtype, shape, offset, nbytes): Ray ships the buffer out of band
(no per-tensor pickling) and maps it read-only from its object store. The policy's weights travel this way
(`cluster/transport.py` adds a shared-memory variant of the same layout); a `Batch` goes as numpy arrays, one
per tensor (data/batch.py).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch


def layout(tensors: dict[str, torch.Tensor]) -> tuple[list[tuple[str, str, tuple, int, int]], int]:
    index, offset = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        offset = -(-offset // 64) * 64  # aligned: a byte view can be viewed as any dtype
        index.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n))
        offset += n
    return index, offset


def write_into(tensors: dict[str, torch.Tensor], index: list, buffer: np.ndarray) -> None:
    flat = torch.from_numpy(buffer)
    for (_, _, _, start, n), t in zip(index, tensors.values()):
        flat[start:start + n].copy_(t.detach().reshape(-1).view(torch.uint8))


def views(buffer: np.ndarray, index: list) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # read-only buffers (object store, read-only map): torch warns
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(buffer)
    return {name: flat[start:start + n].view(getattr(torch, dtype)).view(shape) if n else
            torch.empty(shape, dtype=getattr(torch, dtype)) for name, dtype, shape, start, n in index}


class PackedTensors:
    """The bytes themselves, as one numpy buffer (for the object store, or any node)."""

    def __init__(self, buffer: np.ndarray, index: list):
        self.buffer, self.index = buffer, index

    @classmethod
    def pack(cls, tensors: dict[str, torch.Tensor]) -> PackedTensors:
        index, size = layout(tensors)
        buffer = np.empty(size, dtype=np.uint8)
        write_into(tensors, index, buffer)
        return cls(buffer, index)

    def unpack(self) -> dict[str, torch.Tensor]:
        """Views of the buffer (read-only where it is mapped from Ray's object store: copy before writing)."""
        return views(self.buffer, self.index)
