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

import errno
import numbers
import shutil
from pathlib import Path


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


def is_count(value, low: int = 0, high: int | None = None) -> bool:
    """`value` is a whole number in [low, high]: an int or a numpy integer, not a bool (True is not a count)."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def expect(value, cls, call: str, what: str, hint: str = "") -> None:
    """A UsageError unless `value` is a `cls`: `call` takes `what`, said with what it was given instead (a
    notebook's wrong variable fails here, not as an AttributeError deep inside)."""
    if not isinstance(value, cls):
        raise UsageError(f"{call} takes {what}, got {type(value).__name__}{hint}")


class NonFiniteError(RLBenchError, FloatingPointError):
    """Updates skipped for non-finite numbers train.max_skipped_steps steps in a row: the run stops."""


class RunDirError(RLBenchError, OSError):
    """A file of the run directory could not be written (no space, no permission): what and why."""


def root_cause(error: BaseException) -> BaseException:
    """The error a chain of re-raises started from (a worker's error arrives wrapped, `raise ... from cause`)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def disk_full(error: BaseException, where: Path) -> bool:
    """The file system refused bytes: no space (ENOSPC), over a size limit (EFBIG, EDQUOT) — said so by the
    error or its text (a worker's error under Ray carries only the text) — or any write error while the
    disk is all but full (torch.save's own wordings: "file write failed", "unexpected pos ...")."""
    error = root_cause(error)  # a worker's error, re-raised from its cause: judge the cause
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return True
    if isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return False  # said what it is: a read-only mount or a permission, on a small disk too
    text = str(error)
    return "No space left on device" in text or "File too large" in text or free_bytes(where) < 16 * 2**20


def free_bytes(where: Path) -> int:
    for p in (where, *where.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return 0


def not_recorded(error: OSError, happened: str, fix: str) -> RunDirError:
    """The workers' state changed (`happened`) and the run directory could not say so: the error the session
    raises after marking itself `needs_resync`, with the write's own words and what to do once it can write."""
    if isinstance(error, RunDirError):  # already in words
        what = error.strerror
    else:
        what = write_failure(Path(error.filename), error) if error.filename else str(error)
    return RunDirError(error.errno, f"{what}. {happened}, but the run directory does not record it: once it can be "
                                    f"written, {fix}")


def write_failure(path: Path, error: BaseException) -> str:
    """What went wrong writing `path`, in words a person acts on."""
    if disk_full(error, path.parent):
        return (f"could not write {path}: no space left on its file system ({free_bytes(path.parent) / 2**20:.1f} "
                f"MiB free; {error}). Free some space (or point run.dir elsewhere) and continue")
    if isinstance(error, OSError) and error.errno == errno.EROFS:
        return (f"could not write {path}: its file system is read-only ({error}): remount it writable, or "
                "point run.dir at a writable folder")
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM):
        return (f"could not write {path}: no permission ({error}): make the folder writable for this user, or "
                "point run.dir at a folder you own")
    return f"could not write {path}: {type(error).__name__}: {error}"
