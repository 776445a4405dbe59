"""Reward worker: runs a rule function per sample and never lets one bad sample stop the step.

A reward function is `fn(prompt: str, response: str, **row_fields) -> float` (row fields such as
`answer` come from the dataset), or an `async def` of the same shape. If it raises (even `sys.exit`),
returns NaN, None or a non-number, hangs past `reward.timeout_s`, or — under `reward.isolation=process` —
kills its process, that sample scores 0 and carries the error text in `reward_error`; the count is the
`reward/errors` metric. Numbers are floats, ints, bools, numpy scalars or one-element tensors.

Where the calls run is `rlbench_nb.isolation`: threads of this process, or a pool of worker processes
(the default for your own functions under the local backend, where this process is the notebook's kernel).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import ConfigError, RewardConfig, load_object
from ..data.batch import Batch
from ..isolation import ProcessCalls, ThreadCalls
from ..metrics.memory import memory_snapshot

RewardFn = Callable[..., float]


def load_reward_fn(spec: str) -> RewardFn:
    """'module:function' or 'path/to/file.py:function' -> the function."""
    if ":" not in spec:
        raise ConfigError(f"reward.fn='{spec}' must be 'task', 'module:function' or 'path/file.py:function'")
    fn = load_object(spec, "reward.fn")
    if not callable(fn):
        raise ConfigError(f"reward.fn='{spec}' is not callable")
    return fn


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _is_library_code(fn) -> bool:
    """The package's own functions (the built-in verifiers) are trusted to run in this process."""
    return (getattr(fn, "__module__", None) or "").startswith("rlbench_nb.")


class RewardWorker:
    role = "reward"

    def __init__(self, fn: RewardFn, cfg: RewardConfig | None = None, local_backend: bool = False):
        """`local_backend`: this worker lives in the controller's process (a notebook kernel), where
        reward.isolation=auto runs your own functions in worker processes."""
        self.cfg = cfg or RewardConfig()
        self.local_backend = local_backend
        self._threads = ThreadCalls(self.cfg.concurrency)
        self._processes: ProcessCalls | None = None  # started on first use
        self.fn = fn

    def set_fn(self, fn: RewardFn) -> None:
        self.fn = fn

    def set_config(self, cfg) -> None:
        """A branch's reward settings (timeout; isolation as far as the pools already started allow)."""
        self.cfg = cfg.reward

    @property
    def isolation(self) -> str:
        """'process' or 'thread': where the current function's calls run."""
        mode = self.cfg.isolation
        if mode == "auto":
            mode = "process" if self.local_backend and not _is_library_code(self.fn) else "thread"
        return mode

    def _runner(self):
        if self.isolation == "thread":
            return self._threads
        if self._processes is None:
            self._processes = ProcessCalls(self.cfg.processes, self.cfg.concurrency, self.cfg.max_memory_gb)
        return self._processes

    def score(self, batch: Batch) -> Batch:
        """{"scores_B": float tensor, "reward_error": [str | None], "reward_parts": [dict | None]} for the
        batch's rows (parts: what a `Scored` reward is made of, e.g. `combine`'s; None for a plain float).

        The function gets the dataset row's fields (`batch.info["row_fields"]`, e.g. `answer`), not the
        fields later phases add (advantages, errors)."""
        extra_keys = [k for k in batch.info.get("row_fields", ()) if k in batch.meta]
        calls = [((batch["prompt"][i], batch["response"][i]), {k: batch.meta[k][i] for k in extra_keys})
                 for i in range(len(batch))]
        outcomes = self._runner().run(self.fn, calls, self.cfg.timeout_s)
        scores, errors, parts = [], [], []
        for i, (ok, value) in enumerate(outcomes):
            scores.append(float(value) if ok else 0.0)
            parts.append(getattr(value, "parts", None) if ok else None)
            errors.append(None if ok else f"reward function '{_fn_name(self.fn)}' {value[0]} on sample {i} "
                                          f"(prompt {calls[i][0][0][:40]!r}): {value[1]}")
        return Batch({"scores_B": torch.tensor(scores, dtype=torch.float32)},
                     {"reward_error": errors, "reward_parts": parts})

    def memory(self) -> dict:
        """This process's memory and its isolation pool's (reward.isolation=process)."""
        return memory_snapshot(self._processes.pids() if self._processes is not None else ())

    def close(self) -> None:
        if self._processes is not None:
            self._processes.close()
