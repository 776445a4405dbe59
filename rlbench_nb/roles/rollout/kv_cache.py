"""A KV cache whose layers write each step's keys and values into room reserved once.

`transformers`' DynamicCache grows every layer by `torch.cat`: each decode step copies the layer's whole cache
into a new tensor, and on a CPU each new multi-MB tensor is fresh memory the kernel must fault in page by page.
At SmolLM2-135M's 30 layers, 16 rows and ~300 positions that was 43% of a decode step here (2-core EPYC). A
`ReservedLayer` holds [rows, kv heads, capacity, head dim] buffers and hands the model views of the live rows'
first `length` positions: a step writes one position in place.

Rows dropped at their EOS (`batch_select_indices`) are packed to the front of the same buffers, their filled
positions only, through one scratch tensor all layers share (a new tensor per layer and drop would be fresh
memory again: at 256 rows of a 20M model, that made a step slower than DynamicCache's copies).

Layers of any other kind (sliding-window, linear-attention) stay as transformers made them.
"""
from __future__ import annotations

import math
from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class Scratch:
    """One flat tensor, grown as needed, lent for a copy at a time (layers run one after another)."""

    def __init__(self):
        self.flat = None

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = math.prod(shape)
        if self.flat is None or self.flat.numel() < n or self.flat.dtype != like.dtype \
                or self.flat.device != like.device:
            self.flat = like.new_empty(n)
        return self.flat[:n].view(shape)


class ReservedLayer(DynamicLayer):
    """A DynamicLayer with room for `capacity` positions (more are made room for, by doubling, if asked)."""

    def __init__(self, capacity: int, scratch: Scratch | None = None):
        super().__init__()
        self.capacity, self.length, self.rows = capacity, 0, 0
        self.scratch = scratch or Scratch()
        self._keys = self._values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self.rows = key_states.shape[0]
        end = self.length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:  # the first call, or past the room: double it
            room = max(self.capacity, 2 * end if self._keys is not None else end)
            self._replace_buffers(self.rows, room, key_states, self.keys, self.values)
        self._keys[:self.rows, :, self.length:end].copy_(key_states)
        self._values[:self.rows, :, self.length:end].copy_(value_states)
        self.length = end
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys = self._keys[:self.rows, :, :self.length]
        self.values = self._values[:self.rows, :, :self.length]

    def _replace_buffers(self, rows: int, room: int, like: torch.Tensor, keys, values) -> None:
        """New [rows, kv heads, room, head dim] buffers starting with `keys` / `values` (None: empty)."""
        _, H, _, D = like.shape
        self._keys, self._values = like.new_empty(rows, H, room, D), like.new_empty(rows, H, room, D)
        if keys is not None and keys.shape[-2]:
            self._keys[:, :, :keys.shape[-2]].copy_(keys)
            self._values[:, :, :keys.shape[-2]].copy_(values)

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._keys is None:
            return
        n = len(indices)
        if n > self._keys.shape[0]:  # more rows than there is room for (the n samples of each prompt): new buffers
            self._replace_buffers(n, self._keys.shape[-2], self._keys, self.keys[indices], self.values[indices])
        else:  # pack the kept rows to the front: through the scratch, as source and destination overlap
            for buf in (self._keys, self._values):
                live = buf[:self.rows, :, :self.length]
                kept = self.scratch.take((n, *live.shape[1:]), live)
                torch.index_select(live, 0, indices, out=kept)
                buf[:n, :, :self.length].copy_(kept)
        self.rows = n
        self._views()

    def reset(self) -> None:
        self._keys = self._values = None
        self.length = self.rows = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        # negative: that many positions go; positive (transformers' legacy form): the length to keep
        keep = min(self.length, tokens_to_remove) if tokens_to_remove > 0 else max(0, self.length + tokens_to_remove)
        if self._keys is not None:  # the buffers keep their room
            self.length = keep
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._keys is not None:
            self.batch_select_indices(torch.arange(self.rows, device=self._keys.device).repeat_interleave(repeats))


def reserved_cache(config, capacity: int) -> DynamicCache:
    """A DynamicCache for a model of `config` whose plain attention layers reserve `capacity` positions."""
    cache = DynamicCache(config=config)
    scratch = Scratch()
    cache.layers = [ReservedLayer(capacity, scratch) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # a config that names no layer types: layers made on use
        cache.layer_class_to_replicate = partial(ReservedLayer, capacity, scratch)
    return cache
