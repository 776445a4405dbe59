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

from ..data.packed import PackedTensors, layout, views, write_into

_SHM_DIR = "/dev/shm"
_PREFIX = "rlbench_nb-weights"


class SharedTensors:
    """Where the bytes are: a /dev/shm file on this node, and the index."""

    _maps: dict[str, np.memmap] = {}  # consumer side: one read-only map per file, kept open

    def __init__(self, path: str, index: list):
        self.path, self.index = path, index

    def unpack(self) -> dict[str, torch.Tensor]:
        m = self._maps.get(self.path)
        if m is None:
            for old in list(self._maps):  # the producer moved to a new file (new size): drop the old map
                del self._maps[old]
            m = self._maps[self.path] = np.memmap(self.path, dtype=np.uint8, mode="r")
        return views(m, self.index)


class SharedMemoryWriter:
    """Producer side: one /dev/shm file per actor, created at the first push and rewritten in place."""

    def __init__(self, tag: str):
        self.tag = tag
        self.path: str | None = None
        self.map: np.memmap | None = None
        _remove_stale_files()

    def write(self, tensors: dict[str, torch.Tensor]) -> SharedTensors | None:
        """The tensors in shared memory, or None when /dev/shm cannot hold them (the caller falls back
        to the object store: writing past a full tmpfs would kill the process with SIGBUS)."""
        index, size = layout(tensors)
        if self.map is None or self.map.shape[0] != size:
            self.close()
            st = os.statvfs(_SHM_DIR) if os.path.isdir(_SHM_DIR) else None
            if st is None or st.f_bavail * st.f_frsize < size + (64 << 20):
                return None
            self.path = os.path.join(_SHM_DIR, f"{_PREFIX}-{os.getpid()}-{self.tag}-{size}.bin")
            self.map = np.memmap(self.path, dtype=np.uint8, mode="w+", shape=(max(size, 1),))
        write_into(tensors, index, self.map)
        return SharedTensors(self.path, index)

    def close(self) -> None:
        self.map = None
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
