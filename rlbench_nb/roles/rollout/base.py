"""What every rollout engine shares: the state that exact resume restores, memory reports, no-op hooks."""
from __future__ import annotations

import time

import torch

from ...metrics.memory import memory_snapshot
from ..common import rng_state, set_rng_state

SAMPLES = 256  # elements per tensor a fingerprint reads, a fixed stride through it: a stale or half-loaded tensor
# differs in most of them; each sample is one cache line read, so the cost is ~tensors x SAMPLES, not the bytes


def fingerprints(tensors: list[torch.Tensor], dtypes: list[torch.dtype] | None = None) -> torch.Tensor:
    """A cheap digest per tensor: the float64 sum of a fixed strided sample of its elements, read in `dtypes[i]`
    where given. The same tensor in the same dtype gives the same number exactly, and so does a tensor copied into
    another dtype (a bf16 engine loading fp32 weights) against the original read in that dtype: `copy_` and `to`
    round alike."""
    dtypes = dtypes or [t.dtype for t in tensors]
    return torch.stack([t.detach().reshape(-1)[:: max(1, t.numel() // SAMPLES)].to(d).sum(dtype=torch.float64)
                        for t, d in zip(tensors, dtypes)]).cpu()  # sent (CPU) and held (the engine's device) meet here


def first_difference(sent: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> str | None:
    """The first tensor whose fingerprint differs between what was sent and what the engine holds."""
    names = list(sent)
    if any(k not in held for k in names):
        return next(k for k in names if k not in held)
    a = fingerprints([sent[k] for k in names], dtypes=[held[k].dtype for k in names])
    b = fingerprints([held[k] for k in names])
    if torch.equal(a, b):
        return None
    return names[int((a != b).nonzero()[0])]


class RolloutWorker:
    """Base of the engines. Subclasses implement `generate(batch, params) -> Batch` and
    `set_weights(state, version) -> {"bytes": ...}`; they may override `sleep`/`wake_up` (colocated mode)
    and `close` (engines with processes of their own)."""

    role = "rollout"
    weight_version = 0  # the session step whose policy weights this engine holds, set by a verified set_weights

    # what the controller calls, declared here for every engine (the controller names them by reference:
    # `group.submit_shards(RolloutWorker.generate, ...)`)
    def generate(self, batch, params=None):
        """Sample one response per row (rows are already repeated n times per prompt)."""
        raise NotImplementedError

    def generate_episodes(self, rows, env_cls, params=None):
        """One multi-turn episode per row with a fresh `env_cls()` (envs/, episodes.py)."""
        raise NotImplementedError

    def set_weights(self, state, version: int) -> dict:
        raise NotImplementedError

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _verify(self, sent: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> dict:
        """What `set_weights` adds to its result: `mismatch` (the first tensor the engine does not hold as
        sent, or None) and `verify_s`; the controller raises WeightSyncError on a mismatch."""
        t0 = time.perf_counter()
        bad = first_difference(sent, held)
        return {"mismatch": bad, "verify_s": time.perf_counter() - t0}

    def set_config(self, cfg) -> None:
        """Sampling settings (temperature, top-p, n, lengths) for the next `generate` without params."""
        self.cfg = cfg

    def get_state(self) -> dict:
        """Sampling RNG (torch's: both engines draw from it) and which weights this engine holds."""
        return {"rng": rng_state(), "weight_version": self.weight_version}

    def set_state(self, state: dict) -> None:
        set_rng_state(state["rng"])
        self.weight_version = state["weight_version"]

    def _episodes_setup(self, rows, env_cls):
        """What `generate_episodes` needs: (tokenizer, prompt_ids, rows as dicts, a fresh `env_cls()` per row with
        the config's env.max_turns). The prompt encoding is the session's (chat template, BOS; an observation
        past data.max_prompt_len keeps its end); environment steps run each on a thread of its own."""
        from transformers import AutoTokenizer

        from ...data.batch import Batch
        from ...envs import ThreadPerCall
        from ...prompts import PromptCodec
        if getattr(self, "_codec", None) is None:
            self._codec = PromptCodec(AutoTokenizer.from_pretrained(self.model_dir), self.cfg.data, memo_tokens=0)
            self._env_pool = ThreadPerCall()  # a hung step holds its own thread, not the next steps' slot
        if isinstance(rows, Batch):
            rows = [dict(zip(rows.meta, values)) for values in zip(*rows.meta.values())]
        limit = self.cfg.data.max_prompt_len
        envs = [env_cls() for _ in rows]
        if self.cfg.env.max_turns:
            for env in envs:
                env.max_turns = self.cfg.env.max_turns
        return self._codec.tokenizer, lambda text: self._codec.prompt_ids(text)[-limit:], rows, envs

    def _mark(self, batch) -> None:
        """Called by `generate` before it draws: the state `rewind` returns to, with the draw's tag."""
        from ...data.batch import Batch
        tag = batch.info.get("tag") if isinstance(batch, Batch) else None
        self._before_generate = (tag, self.get_state())

    def rewind(self, tag: str) -> None:
        """Back to the sampling RNG before the draw tagged `tag` (Prompts.encode): a step interrupted after its
        rollout never happened, so the next one draws the same samples (what a resume from a checkpoint saved
        then needs). Nothing when the last draw was another (the step was interrupted before its own): going
        back to an earlier step's draw would repeat that step's samples."""
        marked = getattr(self, "_before_generate", None)
        if marked is not None and marked[0] == tag:
            self.set_state(marked[1])

    def memory(self) -> dict:
        return memory_snapshot()  # of this process (a vLLM engine's own processes are not counted)
