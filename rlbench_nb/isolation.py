"""Running user code (reward functions) so that it cannot take the session down.

    calls = [((prompt, response), {"answer": "42"}), ...]
    outcomes = ThreadCalls(concurrency=8).run(fn, calls, timeout_s=30)     # or ProcessCalls(...)
    # [(True, 1.0), (False, ("ZeroDivisionError", "boom")), (False, ("TimeoutError", "...")), ...]

Both run every call of a batch concurrently under one deadline (a batch of hung calls costs one
timeout, not one per call), put each outcome at its call's index, turn any exception — `SystemExit`
and `KeyboardInterrupt` from user code included — into that call's error, await `async def` functions
(all of a batch's calls on one event loop), and restore the working directory a call changed.

- `ThreadCalls`: threads in this process. Cheap; but a hung call's thread cannot be killed (it is left
  behind, and said so), and `os._exit` or a crash in native code ends the process.
- `ProcessCalls`: a small pool of worker processes (fresh interpreters running this module: none of this
  process's threads, imports or `__main__`), each running its share of the calls on threads. A process still busy at the
  deadline is killed and replaced; one that dies (`os._exit`, a segfault, past `max_memory_gb`) costs
  only the calls it was running: those are retried one per fresh process to find the one that kills it.

This module imports only the standard library and cloudpickle, so the worker processes start in
milliseconds.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

log = logging.getLogger(__name__)

Call = tuple[tuple, dict]                       # (args, kwargs)
Outcome = tuple[bool, Any]                      # (True, value) or (False, (error type name, message))


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch here


def as_number(value: Any) -> float:
    """A reward as a float: bools, ints, floats, numpy scalars and one-element tensors/arrays are numbers;
    NaN, infinities, values float32 cannot hold, None and anything else are errors. A `Scored` (a float with
    its `parts`, rewards/scored.py) stays one, each part checked the same way."""
    parts = getattr(value, "parts", None)
    number = _as_float(value)
    if parts is None:
        return number
    if not (isinstance(parts, dict) and all(isinstance(k, str) for k in parts)):
        raise TypeError(f"returned parts {parts!r}, expected a dict of name -> number")
    checked = {}
    for name, part in parts.items():
        try:
            checked[name] = _as_float(part)
        except (TypeError, ValueError) as e:
            raise type(e)(f"part '{name}' {e}") from None
    from .rewards.scored import Scored  # only when a reward has parts: this module stays light
    return Scored(number, checked)


def _as_float(value: Any) -> float:
    if hasattr(value, "item") and hasattr(value, "shape") and math.prod(value.shape) == 1:
        value = value.item()  # numpy scalar or array, torch tensor
    if isinstance(value, bool):  # numpy bools became Python bools through .item() above
        return float(bool(value))
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    if abs(value) > FLOAT32_MAX:  # a valid Python float, but inf in the float32 batch: every advantage would be NaN
        raise ValueError(f"returned {value!r}, beyond float32's range (+-{FLOAT32_MAX:.3g}) in which rewards are "
                         "kept: scale the reward down")
    return value


def _call(fn: Callable, args: tuple, kwargs: dict) -> Outcome:
    cwd = os.getcwd()
    try:
        return True, as_number(fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - user code: even SystemExit costs only this call
        return False, (type(e).__name__, str(e))
    finally:
        if os.getcwd() != cwd:
            os.chdir(cwd)  # a call that changed directory must not move the next ones


async def _call_async(fn: Callable, args: tuple, kwargs: dict) -> Outcome:
    cwd = os.getcwd()
    try:
        return True, as_number(await fn(*args, **kwargs))
    except asyncio.CancelledError:
        raise  # cut at the batch's deadline: the caller records it as a timeout
    except BaseException as e:  # noqa: BLE001
        return False, (type(e).__name__, str(e))
    finally:
        if os.getcwd() != cwd:
            os.chdir(cwd)


GROW_S = 0.002  # run_here: how long calls may wait before another thread starts on them


def _is_async(fn: Callable) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    call = vars(type(fn)).get("__call__")  # a class's own async __call__ (not a function's wrapper)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def run_here(fn: Callable, calls: list[Call], indices: list[int], timeout_s: float, concurrency: int,
             report: Callable[[int, Outcome], None]) -> list[threading.Thread]:
    """Run `calls[i]` for i in `indices` on up to `concurrency` threads (or one event loop for an async
    `fn`), calling `report(i, outcome)` as each finishes; returns the threads still running at the
    deadline (hung calls)."""
    deadline = time.monotonic() + timeout_s
    if _is_async(fn):
        async def main() -> None:
            async def one(i: int) -> None:
                report(i, await _call_async(fn, *calls[i]))
            tasks = [asyncio.ensure_future(one(i)) for i in indices]
            _, late = await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0))
            for t in late:
                t.cancel()
        # its own thread: the caller may be inside a running event loop (a Jupyter cell)
        threads = [threading.Thread(target=asyncio.run, args=(main(),), daemon=True, name="rlbench-nb-reward")]
        threads[0].start()
    else:
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i in indices:
            todo.put(i)

        def worker() -> None:
            while time.monotonic() < deadline:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                report(i, _call(fn, *calls[i]))
        # one thread, then one more every GROW_S while calls still wait, up to `concurrency`: a cheap function's
        # batch runs on one thread (starting a thread costs ~0.1-1 ms, more than 64 cheap calls), a slow one (an
        # API, a sandbox) reaches full concurrency within concurrency x GROW_S
        threads = []
        while len(threads) < max(1, min(concurrency, len(indices))) and not todo.empty():
            threads.append(threading.Thread(target=worker, daemon=True, name="rlbench-nb-reward"))
            threads[-1].start()
            threads[-1].join(GROW_S)
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    return [t for t in threads if t.is_alive()]


def _timed_out(timeout_s: float) -> Outcome:
    return False, ("TimeoutError", f"no result within reward.timeout_s={timeout_s:g}s (hung?)")


class ThreadCalls:
    """All of a batch's calls on threads of this process."""

    def __init__(self, concurrency: int = 8):
        self.concurrency = concurrency
        self.abandoned = 0  # threads left running past a deadline (hung calls): they cannot be killed

    def run(self, fn: Callable, calls: list[Call], timeout_s: float) -> list[Outcome]:
        results: dict[int, Outcome] = {}
        lock = threading.Lock()

        def report(i: int, outcome: Outcome) -> None:
            with lock:
                results.setdefault(i, outcome)  # a late result of an abandoned call never overwrites

        hung = run_here(fn, calls, list(range(len(calls))), timeout_s, self.concurrency, report)
        with lock:
            out = [results.setdefault(i, _timed_out(timeout_s)) for i in range(len(calls))]
        if hung:
            self.abandoned += len(hung)
            log.warning("%d reward call thread(s) hung past reward.timeout_s=%gs and cannot be stopped (%d so far "
                        "in this process); reward.isolation=process kills hung calls instead", len(hung),
                        timeout_s, self.abandoned)
        return out

    def close(self) -> None:
        pass


# ---- processes ------------------------------------------------------------------------------------
def _child_main(conn, concurrency: int, max_memory_gb: float | None) -> None:
    """A worker process: receives (function, calls), sends each outcome back as it finishes."""
    import cloudpickle
    if max_memory_gb:
        import resource
        limit = int(max_memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    send_lock = threading.Lock()
    fn = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        _, blob, calls, timeout_s = msg
        if blob is not None:
            fn = cloudpickle.loads(blob)
        indices = [i for i, _ in calls]
        by_index = dict(calls)

        def report(i: int, outcome: Outcome) -> None:
            with send_lock:
                conn.send(("result", i, outcome))

        run_here(fn, by_index, indices, timeout_s, concurrency, report)
        with send_lock:
            conn.send(("done",))


class _Child:
    """`python -m rlbench_nb.isolation FD ...`: a fresh interpreter talking over a socket pair."""

    def __init__(self, concurrency: int, max_memory_gb: float | None):
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # functions by reference
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlbench_nb.isolation", str(theirs.fileno()), str(concurrency),
             str(max_memory_gb or 0)], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.fn_key: object = None  # which function the process holds

    def exit_code(self) -> int | None:
        try:
            return self.proc.wait(1)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
            self.proc.wait(2)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.conn.close()


class ProcessCalls:
    """All of a batch's calls on a pool of worker processes, each running its share on threads."""

    def __init__(self, processes: int = 2, concurrency: int = 8, max_memory_gb: float | None = None):
        self.processes, self.concurrency, self.max_memory_gb = max(1, processes), concurrency, max_memory_gb
        self._children: list[_Child] = []
        self._blob: tuple[object, bytes] | None = None  # (function, its pickle), pickled once per function

    def _child(self) -> _Child:
        return _Child(self.concurrency, self.max_memory_gb)

    def _pickled(self, fn: Callable) -> tuple[object, bytes]:
        if self._blob is None or self._blob[0] is not fn:
            import cloudpickle
            self._blob = (fn, cloudpickle.dumps(fn))
        return self._blob

    def run(self, fn: Callable, calls: list[Call], timeout_s: float) -> list[Outcome]:
        deadline = time.monotonic() + timeout_s
        key, blob = self._pickled(fn)
        while len(self._children) < self.processes:
            self._children.append(self._child())
        results: dict[int, Outcome] = {}
        busy: dict[Any, tuple[_Child, set[int], bool]] = {}  # conn -> (process, calls left, alone?)

        def send(child: _Child, indices: list[int], alone: bool) -> None:
            child.conn.send(("run", None if child.fn_key is key else blob, [(i, calls[i]) for i in indices],
                             max(deadline - time.monotonic(), 0)))
            child.fn_key = key
            busy[child.conn] = (child, set(indices), alone)

        for k, child in enumerate(self._children):
            if calls[k::self.processes]:
                send(child, list(range(len(calls)))[k::self.processes], alone=False)
        while busy:
            ready = wait_for_connections(list(busy), timeout=max(deadline - time.monotonic(), 0))
            if not ready:  # the deadline: whatever is still running is hung — kill it
                for child, _, alone in busy.values():
                    child.kill() if alone else self._replace(child)
                break
            for conn in ready:
                child, left, alone = busy[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the process died under one of its calls
                    del busy[conn]
                    if alone:  # this call is the one that kills its process
                        code = child.exit_code()
                        results.update({i: (False, ("ProcessDied", f"the reward process died running this call "
                                                    f"(exit code {code}): os._exit, a crash, or past "
                                                    "reward.max_memory_gb")) for i in left})
                        child.kill()
                    else:  # which of its calls did it? each gets a fresh process of its own
                        self._replace(child)
                        for i in sorted(left):
                            send(self._child(), [i], alone=True)
                    continue
                if msg[0] == "result":
                    results[msg[1]] = msg[2]
                    left.discard(msg[1])
                else:  # "done"
                    del busy[conn]
                    if alone:
                        child.stop()
        return [results.get(i, _timed_out(timeout_s)) for i in range(len(calls))]

    def pids(self) -> list[int]:
        """The pool's live processes (their memory is the reward role's: metrics/memory.py)."""
        return [c.proc.pid for c in self._children if c.proc.poll() is None]

    def _replace(self, child: _Child) -> None:
        child.kill()
        self._children[self._children.index(child)] = self._child()

    def close(self) -> None:
        for child in self._children:
            child.stop()
        self._children = []


if __name__ == "__main__":  # a worker process of ProcessCalls
    _child_main(Connection(int(sys.argv[1])), int(sys.argv[2]), float(sys.argv[3]) or None)
