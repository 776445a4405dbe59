"""One base class for every error rlbench-nb raises on purpose.

    try:
        sess.run(steps=100)
    except rl.RLBenchError as e:     # a problem the message explains (config, data, cluster, worker, ...)
        print(e)

Each subclass keeps the builtin base a caller would already catch (`ConfigError` is a `ValueError`,
`WorkerError` a `RuntimeError`), so code written against those keeps working. The CLI turns an
`RLBenchError` into one line and exit status 2; anything else is a bug and keeps its traceback.
The subclasses live beside the code that raises them; the ones with no better home live here.
"""
from __future__ import annotations


class RLBenchError(Exception):
    """A problem rlbench-nb detected and explained: the message names the thing and the fix."""


class SessionStateError(RLBenchError, RuntimeError):
    """The session cannot do this now: closed, busy with a background run, or waiting to re-synchronise."""


class BackgroundRunError(RLBenchError, RuntimeError):
    """A background run failed; the cause is chained (`__cause__`) and kept as `.error`."""

    def __init__(self, message: str, error: BaseException | None = None):
        super().__init__(message)
        self.error = error

    def __reduce__(self):
        return (type(self), (str(self), self.error))


class UsageError(RLBenchError, ValueError):
    """A call that cannot be done as asked (an unprepared batch, an unknown role or column, a function
    that cannot be shipped to the workers): the message says what to pass instead."""


class NonFiniteError(RLBenchError, FloatingPointError):
    """Updates skipped for non-finite numbers train.max_skipped_steps steps in a row: the run stops."""
