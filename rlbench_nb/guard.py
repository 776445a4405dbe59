"""Who may drive a session, and when: one phase at a time, from the thread that owns the session, and
Ctrl-C that never lands half-way through a phase.

    guard = SessionGuard()
    with guard.phase("update", changes_state=True):   # refused if closed, needs re-sync, or owned elsewhere
        ...

A notebook user interrupts cells all the time. Inside `deferred_interrupts()` the first SIGINT is held
until the block has finished, then raised as KeyboardInterrupt: the work already on its way (an optimizer
step, a weight push, the step's bookkeeping) completes and is recorded. A second SIGINT raises at once,
abandoning the block; the caller then knows its state may be half-changed.

    with deferred_interrupts() as held:
        do_the_phase()
    # KeyboardInterrupt raised here if Ctrl-C came during the block (held.abandoned says whether twice)

Only the main thread receives signals (Python's rule); elsewhere the block just runs. Blocks nest: an
inner one inside an outer one holds nothing of its own (the outer one decides when to raise). A process that
started with SIGINT ignored (a script run as `cmd &` from a shell without job control, or under `nohup`-like
launchers) keeps ignoring it inside blocks too: catching it only there would honour half the Ctrl-Cs.
"""
from __future__ import annotations

import logging
import signal
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import SessionStateError, not_recorded

log = logging.getLogger(__name__)


@dataclass
class Held:
    count: int = 0

    @property
    def abandoned(self) -> bool:
        return self.count >= 2


class Abandoned(KeyboardInterrupt):
    """A second Ctrl-C: the block was left half-way."""


_active: list[Held] = []  # the outermost block's record, while one is open (main thread only)


@contextmanager
def deferred_interrupts(what: str = "the current phase"):
    if (threading.current_thread() is not threading.main_thread() or _active
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):  # ignored (a job started with `&`): it stays so
        yield _active[0] if _active else Held()
        return
    held = Held()

    def on_sigint(signum, frame):
        held.count += 1
        if held.count >= 2:
            raise Abandoned(f"interrupted twice: {what} was abandoned half-way")
        log.warning("interrupt: finishing %s first, so the session stays consistent (interrupt again to "
                    "abandon it)", what)

    previous = signal.signal(signal.SIGINT, on_sigint)
    _active.append(held)
    try:
        yield held
    finally:
        _active.clear()
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if held.count:
        raise KeyboardInterrupt(f"interrupted; {what} completed first")


class SessionGuard:
    """A session's state ('starting', 'ready', 'running', 'needs_resync', 'closed'), its owner thread while
    a background run steps it, and the lock that lets one phase run at a time."""

    def __init__(self):
        self.state = "starting"
        self.owner: int | None = None       # the background run's thread; phases from others are refused
        # a new one at every phase that may change the workers' weights (update, load, restore, restart) and at
        # a branch's return to the main line: what was computed from the weights (the critic's values) is reused
        # only within the epoch it was computed in. Unique across sessions and processes: a batch carried to
        # another session never matches its epoch.
        self.epoch = ""
        self.weights_changed()
        self._lock = threading.RLock()

    def weights_changed(self) -> None:
        self.epoch = uuid.uuid4().hex

    @contextmanager
    def phase(self, what: str, changes_state: bool = False, repairs: bool = False):
        """Run a phase: refused (SessionStateError, saying what to do) when the session is closed, needs
        re-synchronising (unless this phase `repairs` it: a load or restart), or is being stepped by a
        background run from another thread. Ctrl-C waits for the phase to end; a second Ctrl-C abandons
        it, and after one that `changes_state` (an update, a load) the workers may hold a half-applied
        step: the session then refuses phases until re-synced."""
        self.check(what, repairs)
        with self._lock, deferred_interrupts(what):
            if changes_state:
                self.weights_changed()
            try:
                yield
            except Abandoned:
                if changes_state:
                    self.state = "needs_resync"
                raise
            if repairs and self.state == "needs_resync":
                self.state = "ready"

    @contextmanager
    def recording(self, done: str, fix: str = "sess.resync() returns every role to the latest checkpoint"):
        """Writing the record of what the workers `done` already (an update, a way back): a write that fails (no
        space, a read-only mount) leaves the session `needs_resync`, never `ready` at a step its files do not
        hold; the error says what was done and the `fix` (errors.not_recorded)."""
        try:
            yield
        except OSError as e:
            self.state = "needs_resync"
            raise not_recorded(e, done, fix) from e

    def check(self, what: str, repairs: bool = False) -> None:
        """Raise SessionStateError, saying what to do, where `phase(what)` would be refused."""
        if self.state == "closed":
            raise SessionStateError(f"cannot {what}: the session is closed; start a new one, or "
                                    "rl.Session.load(run_dir) to continue from its latest checkpoint")
        if self.state == "needs_resync" and not repairs:
            raise SessionStateError(f"cannot {what}: an interrupted update may have left the workers half-way "
                                    "through a step; call sess.resync() to return to the latest checkpoint")
        if self.owner is not None and self.owner != threading.get_ident():
            raise SessionStateError(f"cannot {what} while a background run is stepping this session: "
                                    "sess.stop() it (or sess.pause()) and wait for it to end, then try again")

    @contextmanager
    def owned_by_this_thread(self):
        """A background run's thread: phases from any other thread are refused until it ends."""
        self.owner = threading.get_ident()
        self.state = "running"
        try:
            yield
        finally:
            self.owner = None
            if self.state == "running":
                self.state = "ready"
