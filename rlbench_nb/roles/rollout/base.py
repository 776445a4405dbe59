"""What every rollout engine shares: the state that exact resume restores, memory reports, no-op hooks."""
from __future__ import annotations

from ...metrics.memory import memory_snapshot
from ..common import rng_state, set_rng_state


class RolloutWorker:
    """Base of the engines. Subclasses implement `generate(batch, params) -> Batch` and
    `set_weights(state, version) -> {"bytes": ...}`; they may override `sleep`/`wake_up` (colocated mode)
    and `close` (engines with processes of their own)."""

    role = "rollout"
    weight_version = 0

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get_state(self) -> dict:
        """Sampling RNG (torch's: both engines draw from it) and which weights this engine holds."""
        return {"rng": rng_state(), "weight_version": self.weight_version}

    def set_state(self, state: dict) -> None:
        set_rng_state(state["rng"])
        self.weight_version = state["weight_version"]

    def _mark(self) -> None:
        """Called by `generate` before it draws: the state `rewind` returns to."""
        self._before_generate = self.get_state()

    def rewind(self) -> None:
        """Back to the sampling RNG before the last `generate`: a step interrupted after its rollout never
        happened, so the next one draws the same samples (what a resume from a checkpoint saved then needs)."""
        if getattr(self, "_before_generate", None) is not None:
            self.set_state(self._before_generate)

    def memory(self) -> dict:
        return memory_snapshot()  # of this process (a vLLM engine's own processes are not counted)
