"""The environment interface, and how a rollout worker runs one step of it."""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass


class Env:
    """One episode's environment: a rollout makes one instance per episode (so state on `self` is the
    episode's), calls `reset(row)` for the first observation, then `step(text)` after each of the model's turns
    until it says `done`, `max_turns` turns were taken, or the episode's token budget is spent.

    Subclass it in a notebook cell (it is shipped to the rollout workers with cloudpickle, like a reward
    function) or in a module (`env.fn: my.module:MyEnv`)."""

    max_turns: int = 4
    """The model's turns in one episode; the last one is scored as it stands."""
    stop_strings: tuple[str, ...] = ()
    """Besides EOS, text that ends the model's turn (ToolEnv: the tag that closes a call)."""

    def reset(self, row: dict) -> str:
        """The first observation, given the data row (its 'prompt', 'answer', ...): by default the prompt."""
        self.row = row
        return row["prompt"]

    def step(self, action_text: str) -> tuple[str | None, float, bool]:
        """The model's turn (its text up to and including the end of its action) -> (observation or None,
        reward, done). An observation is appended to the episode as environment tokens (no loss on them);
        rewards of all steps add up to the episode's score."""
        raise NotImplementedError(f"{type(self).__name__}.step(action_text) -> (observation, reward, done)")


def load_env(spec: str) -> type[Env]:
    """`env.fn`: 'module:Class' or 'path/file.py:Class' -> the Env subclass."""
    from ..config import ConfigError, load_object
    if ":" not in spec:
        raise ConfigError(f"env.fn='{spec}' must be 'module:Class' or 'path/file.py:Class'")
    cls = load_object(spec, "env.fn")
    check_env(cls, f"env.fn='{spec}'")
    return cls


def check_env(cls, what: str) -> None:
    from ..errors import UsageError
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise UsageError(f"{what} is {cls!r}, not a subclass of rlbench_nb.envs.Env: write "
                         "class MyEnv(Env) with reset(row) and step(action_text) (or ToolEnv with tools)")


class ThreadPerCall(concurrent.futures.Executor):
    """Runs each call on a (daemon) thread of its own. A call that hangs holds only its own thread: in a fixed
    pool it would hold a slot, and the calls queued behind it would run out their timeouts waiting. Past
    MAX_THREADS threads in the process (calls that hung and never returned pile up) a call fails at once, as a
    thread that cannot start does: the caller's error, never a dead batch."""

    MAX_THREADS = 2000

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if threading.active_count() >= self.MAX_THREADS:
            future.set_exception(RuntimeError(f"{threading.active_count()} threads are running in this process "
                                              "(calls that hung and never returned?): not starting another"))
            return future

        def run():
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 — handed to whoever waits on the future
                future.set_exception(e)

        try:
            threading.Thread(target=run, daemon=True, name=f"rlbench-call-{getattr(fn, '__name__', 'fn')}").start()
        except RuntimeError as e:  # "can't start new thread": the call fails, its caller goes on
            future.set_exception(e)
        return future


@dataclass
class EnvStep:
    observation: str | None
    reward: float
    done: bool
    error: str | None = None  # the step raised or overran: the episode ends here with reward 0


def run_step(env: Env, action_text: str, pool: concurrent.futures.Executor, timeout_s: float) -> EnvStep:
    """`env.step(action_text)` on `pool`, at most `timeout_s` seconds (see `run_steps`)."""
    return run_steps([(env, action_text)], pool, timeout_s)[0]


def run_steps(calls: list[tuple[Env, str]], pool: concurrent.futures.Executor, timeout_s: float) -> list[EnvStep]:
    """Each `env.step(action_text)` at once on `pool`, all within `timeout_s` seconds of the start. A step that
    raises, overruns or returns something else than (observation, reward, done) ends its episode with the reason
    in `error`; the others go on. (A thread that overruns cannot be stopped; it finishes in the background.)"""
    deadline = time.monotonic() + timeout_s
    futures = [pool.submit(env.step, text) for env, text in calls]
    return [_finish(env, future, deadline, timeout_s) for (env, _), future in zip(calls, futures)]


def _finish(env: Env, future: concurrent.futures.Future, deadline: float, timeout_s: float) -> EnvStep:
    name = type(env).__name__
    try:
        out = future.result(timeout=max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
        return EnvStep(None, 0.0, True, f"{name}.step took longer than {timeout_s:g} s")
    except Exception as e:  # noqa: BLE001 — the environment's own bug: it ends this episode, not the batch
        return EnvStep(None, 0.0, True, f"{name}.step raised {type(e).__name__}: {e}")
    try:
        observation, reward, done = out
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"observation is {type(observation).__name__}")
        return EnvStep(observation, float(reward), bool(done))
    except (TypeError, ValueError) as e:
        return EnvStep(None, 0.0, True, f"{name}.step must return (observation: str | None, reward: float, "
                                        f"done: bool), got {out!r:.80} ({e})")
