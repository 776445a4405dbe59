"""How a dict of tensors (the policy's weights) travels from one Ray actor to another.

    blob = pack(weights, shm_writer)   # in the producer: SharedTensors when /dev/shm has room, else PackedTensors
    weights = blob.unpack()            # in the consumer: tensors viewing the bytes; copy them before the next pack

Both forms are one flat byte buffer plus an index of (name, dtype, shape, offset, nbytes), so neither
pickles tensors one by one. `PackedTensors` carries the buffer as a numpy array: Ray stores it out of
band and a reader maps it from the object store. `SharedTensors` is only a path and the index: the bytes
sit in a file in /dev/shm that the producer rewrites in place each time, so a same-node push costs two
memory copies and no object-store round trip (~5 ms -> ~2 ms for 2.6 MB on the 2-core machine,
benchmarks/controller_overhead.py). The controller picks the shared-memory form only when producer and
consumer are on one node; the consumer must be done with one push before the producer writes the next
(the controller waits for `set_weights` before the next update).
"""
from __future__ import annotations

import glob
import os

import numpy as np
import torch

from ..data.packed import PackedTensors, layout, views

_SHM_DIR = "/dev/shm"
_PREFIX = "rlbench_nb-weights"


class SharedTensors:
    """Where the bytes are: a /dev/shm file on this node, and the index."""

    # consumer side: per file, its read-only map and the views of the last index. The producer rewrites the same
    # file in place, so one push's views are the next one's: made again (~40 tensor views: 0.1 ms, 0.6 ms in a
    # tiny Ray step's push, before the engine's load starts) only when the layout changes.
    _maps: dict[str, tuple[np.memmap, list, dict[str, torch.Tensor]]] = {}

    def __init__(self, path: str, index: list):
        self.path, self.index = path, index

    def unpack(self) -> dict[str, torch.Tensor]:
        m, index, tensors = self._maps.get(self.path, (None, None, {}))
        if m is None:
            self._maps.clear()  # the producer moved to a new file (new size): drop the old map
            m = np.memmap(self.path, dtype=np.uint8, mode="r")
        if index != self.index:
            tensors = views(m, self.index)
        self._maps[self.path] = (m, self.index, tensors)
        return dict(tensors)


class SharedMemoryWriter:
    """Producer side: one /dev/shm file per actor, created at the first push and rewritten in place."""

    def __init__(self, tag: str):
        self.tag = tag
        self.path: str | None = None
        self.map: np.memmap | None = None
        # the file's layout, kept while pushes bring the same (name, dtype, shape)s: its index and a view per tensor
        self._kinds: list[tuple] = []
        self._index: list = []
        self._views: list[torch.Tensor] = []
        _remove_stale_files()

    def write(self, tensors: dict[str, torch.Tensor]) -> SharedTensors | None:
        """The tensors in shared memory, or None when /dev/shm cannot hold them (the caller falls back
        to the object store: writing past a full tmpfs would kill the process with SIGBUS)."""
        kinds = [(name, t.dtype, t.shape) for name, t in tensors.items()]
        if kinds != self._kinds:
            index, size = layout(tensors)
            if self.map is None or self.map.shape[0] != size:
                self.close()
                st = os.statvfs(_SHM_DIR) if os.path.isdir(_SHM_DIR) else None
                if st is None or st.f_bavail * st.f_frsize < size + (64 << 20):
                    return None
                self.path = os.path.join(_SHM_DIR, f"{_PREFIX}-{os.getpid()}-{self.tag}-{size}.bin")
                self.map = np.memmap(self.path, dtype=np.uint8, mode="w+", shape=(max(size, 1),))
            self._kinds, self._index, self._views = kinds, index, list(views(self.map, index).values())
        with torch.no_grad():  # one call for every tensor: a copy per tensor is ~5 tensor ops of Python each
            torch._foreach_copy_(self._views, list(tensors.values()))
        return SharedTensors(self.path, self._index)

    def close(self) -> None:
        self.map, self._kinds, self._index, self._views = None, [], [], []
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.path = None


def _remove_stale_files() -> None:
    """Files left by producers that were killed (their pid is gone): they would hold memory until reboot."""
    for path in glob.glob(os.path.join(_SHM_DIR, f"{_PREFIX}-*.bin")):
        try:
            pid = int(os.path.basename(path).split("-")[2])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except (ValueError, IndexError, PermissionError):
            pass


def pack(tensors: dict[str, torch.Tensor], shm: SharedMemoryWriter | None) -> SharedTensors | PackedTensors:
    """Shared memory when a writer is given and there is room, else the bytes."""
    return (shm.write(tensors) if shm is not None else None) or PackedTensors.pack(tensors)
