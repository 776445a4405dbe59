"""Reward worker: runs a rule function per sample and never lets one bad sample stop the step.

A reward function is `fn(prompt: str, response: str, **row_fields) -> float` (row fields such as
`answer` come from the dataset). If it raises, or returns NaN, None or a non-number, that sample
scores 0 and carries the error text in `reward_error`; the count is the `reward/errors` metric.

A call that runs longer than `reward.timeout_s` is cut: the sample scores 0 with a timeout error and
the step goes on. Calls run on a helper thread so they can be timed out; a call that never returns
cannot be killed from Python, so its thread is abandoned (it holds no lock the next calls need) and a
fresh one takes the remaining samples.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import queue
import threading
from pathlib import Path
from typing import Callable

import torch

from ..data.batch import Batch
from ..metrics.memory import memory_snapshot

RewardFn = Callable[..., float]


def load_reward_fn(spec: str) -> RewardFn:
    """'module:function' or 'path/to/file.py:function' -> the function."""
    if ":" not in spec:
        raise ValueError(f"reward.fn='{spec}' must be 'task', 'module:function' or 'path/file.py:function'")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.exists():
                raise FileNotFoundError(f"file {path} does not exist")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        fn = getattr(module, name)
    except (ImportError, AttributeError, FileNotFoundError) as e:
        raise ValueError(f"reward.fn='{spec}' could not be loaded: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward.fn='{spec}' is not callable")
    return fn


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class _CallThread:
    """A daemon thread that runs `fn` over a list of calls, handing each result back as it finishes; the
    caller waits at most `timeout` for each. One hand-off per batch, not per call."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self.cancelled = False
        threading.Thread(target=self._loop, name="rlbench-nb-reward", daemon=True).start()

    def _loop(self):
        while True:
            fn, calls = self._jobs.get()
            for args, kwargs in calls:
                if self.cancelled:  # abandoned after a hang: leave the rest to the next thread
                    return
                try:
                    self._results.put((True, fn(*args, **kwargs)))
                except BaseException as e:  # handed back to the caller, who decides
                    self._results.put((False, e))

    def start(self, fn, calls: list) -> None:
        self._jobs.put((fn, calls))

    def next(self, timeout: float):
        """The next call's result; raises what it raised, or TimeoutError (drop this thread then)."""
        try:
            ok, value = self._results.get(timeout=timeout)
        except queue.Empty:
            self.cancelled = True
            raise TimeoutError(f"no result within reward.timeout_s={timeout:g}s (hung?)") from None
        if not ok:
            raise value
        return value


class RewardWorker:
    role = "reward"

    def __init__(self, fn: RewardFn, timeout_s: float = 30.0):
        self.fn = fn
        self.timeout_s = timeout_s
        self._thread = _CallThread()

    def set_fn(self, fn: RewardFn) -> None:
        self.fn = fn

    def score(self, batch: Batch) -> Batch:
        """{"scores_B": float tensor, "reward_error": [str | None]} for the batch's rows.

        The function gets the dataset row's fields (`batch.info["row_fields"]`, e.g. `answer`), not the
        fields later phases add (advantages, errors)."""
        extra_keys = [k for k in batch.info.get("row_fields", ()) if k in batch.meta]
        calls = [((batch["prompt"][i], batch["response"][i]), {k: batch.meta[k][i] for k in extra_keys})
                 for i in range(len(batch))]
        scores, errors = [], []
        self._thread.start(self.fn, calls)
        try:
            self._collect(calls, scores, errors)
        except BaseException:  # interrupted mid-batch: its leftover results must not reach the next batch
            self._thread.cancelled = True
            self._thread = _CallThread()
            raise
        return Batch({"scores_B": torch.tensor(scores, dtype=torch.float32)}, {"reward_error": errors})

    def _collect(self, calls: list, scores: list, errors: list) -> None:
        for i, ((prompt, _), _) in enumerate(calls):
            try:
                try:
                    value = self._thread.next(self.timeout_s)
                except TimeoutError:
                    self._thread = _CallThread()  # the stuck one is abandoned; a fresh one takes the rest
                    self._thread.start(self.fn, calls[i + 1:])
                    raise
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise TypeError(f"returned {type(value).__name__} {value!r}, expected a float")
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}")
                scores.append(value)
                errors.append(None)
            except Exception as e:  # one bad sample must not stop the step
                scores.append(0.0)
                errors.append(f"reward function '{_fn_name(self.fn)}' {type(e).__name__} on sample {i} "
                              f"(prompt {prompt[:40]!r}): {e}")

    def memory(self) -> dict:
        return memory_snapshot()
