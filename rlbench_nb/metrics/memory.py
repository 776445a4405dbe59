"""Process memory, measured where the work runs; every worker call carries a snapshot back."""
from __future__ import annotations

import os
import resource

import torch


def memory_snapshot() -> dict:
    """Process RSS now and at peak (GB), and CUDA allocated/peak when a GPU is present."""
    snap = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            snap["rss_gb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        pass
    if torch.cuda.is_available():
        snap["gpu_alloc_gb"] = torch.cuda.memory_allocated() / 2**30
        snap["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return snap
