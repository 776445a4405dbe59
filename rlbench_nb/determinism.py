"""`run.deterministic`: the same seed, config and rank layout give bit-identical weights, however the run is
driven (a notebook, the exported script, `ray job submit`, a controller killed and re-attached).

What it fixes, in every process of the run (the controller, a local backend's workers, each Ray actor):
- torch's CPU thread count, to `cluster.num_threads` (1 when that is 0): a parallel reduction splits its work
  by thread count, and another split rounds differently in the last bit; the default count follows the
  process's environment (Ray sets OMP_NUM_THREADS for its actors, a job driver or kernel may not);
- `torch.use_deterministic_algorithms(True)`, with the cuBLAS workspace it needs on CUDA and cuDNN's
  autotuner off: an op with no deterministic implementation raises instead of drifting;
- sampling seeded per draw: a rollout samples from a generator seeded with (run.seed, its data position), not
  from the process's running RNG, so a step redone after a killed controller, an interrupt or a restore draws
  the same tokens wherever the interruption fell (see `sample_seeds`).

docs/determinism.md says which guarantees hold where (CPU vs GPU, HF engine vs vLLM) and what they cost.
"""
from __future__ import annotations

import hashlib
import os
import random

import torch

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic reductions need it (CUDA docs, "Results reproducibility")


def seed_process(cfg) -> None:
    """The controller's process: its threads and algorithms (configure_process), and torch's and Python's
    RNGs seeded with `run.seed`."""
    configure_process(cfg.cluster.num_threads, cfg.run.deterministic)
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)


def configure_process(num_threads: int, deterministic: bool) -> None:
    """Thread count and algorithm choice for this process; called where a process of the run starts."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # read when CUDA first starts
        torch.set_num_threads(num_threads or 1)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif num_threads:
        torch.set_num_threads(num_threads)


def sample_seeds(run_seed: int, key: tuple, rows: int) -> torch.Tensor:
    """`sample_seed_B` for a rollout's rows: consecutive seeds from a base hashed from (run.seed, key). A rollout
    engine seeds one generator with the first seed of the rows it is given (`sampling_generator`): a shard's
    rows differ from every other shard's, so each rank draws its own stream, the same one every time."""
    digest = hashlib.sha256(repr((run_seed, *key)).encode()).digest()
    base = int.from_bytes(digest[:6], "little")  # 48 bits: room below 2**63 for any number of rows
    return base + torch.arange(rows, dtype=torch.long)


def sampling_generator(batch, device: torch.device | str) -> torch.Generator | None:
    """The generator a rollout engine samples `batch` with: seeded from its `sample_seed_B` under
    run.deterministic, None (torch's process RNG) otherwise."""
    if "sample_seed_B" not in batch:
        return None
    return torch.Generator(device=device).manual_seed(int(batch["sample_seed_B"][0]))
