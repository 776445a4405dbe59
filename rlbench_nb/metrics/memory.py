"""Process memory, measured where the work runs; every worker call carries a snapshot back."""
from __future__ import annotations

import os
import resource

import torch


def memory_snapshot(helpers: list[int] | tuple[int, ...] = ()) -> dict:
    """Process RSS now and at peak (GB), and CUDA allocated/peak when a GPU is present. `helpers`: pids of
    processes working for this one (a reward's isolation pool): their resident memory is the role's too, so
    it is added (the peak as the sum of each process's own peak: at most what they held at once)."""
    snap = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            snap["rss_gb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        pass
    for pid in helpers:
        status = _status_kb(pid)
        snap["peak_rss_gb"] += status.get("VmHWM", 0) / 2**20
        if "rss_gb" in snap:
            snap["rss_gb"] += status.get("VmRSS", 0) / 2**20
    if torch.cuda.is_available():
        snap["gpu_alloc_gb"] = torch.cuda.memory_allocated() / 2**30
        snap["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return snap


def _status_kb(pid: int) -> dict[str, int]:
    """The kB figures of /proc/<pid>/status (VmRSS: resident now, VmHWM: its peak); {} for a gone process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rows = [line.split() for line in f]
    except OSError:
        return {}
    return {row[0].rstrip(":"): int(row[1]) for row in rows if len(row) == 3 and row[2] == "kB"}
