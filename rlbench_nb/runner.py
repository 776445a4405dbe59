"""Background runs: `sess.run(steps, background=True)` in a Jupyter kernel.

The run's loop is the ordinary `Session.run` body, executed in a worker thread by an asyncio task on the
kernel's loop, so the kernel stays free for other cells and widget clicks. `RunControl` is checked at
every step boundary: pause, resume and stop never interrupt a phase, so no update is half-applied.
A failure is kept, shown in the dashboard, and raised by the session's next `run()`.
"""
from __future__ import annotations

import asyncio
import threading


class RunControl:
    def __init__(self):
        self._go = threading.Event()
        self._go.set()
        self.stopped = False

    def pause(self) -> None:
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self.stopped = True
        self._go.set()

    @property
    def paused(self) -> bool:
        return not self._go.is_set()

    def proceed(self) -> bool:
        """Block while paused; False once stopped."""
        self._go.wait()
        return not self.stopped


class BackgroundRun:
    """Handle on a run started with `background=True`; `await run` gives its summary."""

    def __init__(self, session, control: RunControl):
        self.session, self.control = session, control
        self.task: asyncio.Task | None = None
        self.summary: dict | None = None
        self.error: BaseException | None = None

    @classmethod
    def start(cls, session, steps, async_rollout: bool, on_failure: str = "raise") -> "BackgroundRun":
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("run(background=True) needs a running event loop (a Jupyter kernel); "
                               "in a script call run() without it") from None
        if session.background is not None and not session.background.done:
            raise RuntimeError("a background run is already going: sess.stop() it first")
        session._raise_pending_error()
        run = cls(session, RunControl())
        session.background = run
        run.task = loop.create_task(run._main(steps, async_rollout, on_failure))  # a reference is kept: tasks can vanish
        return run

    async def _main(self, steps, async_rollout, on_failure="raise") -> dict | None:
        sess = self.session
        try:
            self.summary = await asyncio.to_thread(sess.run, steps, False, async_rollout, False, self.control,
                                                   on_failure)
        except BaseException as e:  # kept for the dashboard and the next interaction
            self.error = e
            sess._pending_error = e
            sess.state = "failed"
        for listener in list(sess._listeners):
            listener(None)  # final redraw with the end state
        return self.summary

    @property
    def done(self) -> bool:
        return self.task is None or self.task.done()

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.done:
            return "stopped" if self.control.stopped else "finished"
        return "paused" if self.control.paused else "running"

    def pause(self) -> None:
        self.control.pause()

    def resume(self) -> None:
        self.control.resume()

    def stop(self) -> None:
        self.control.stop()

    def __await__(self):
        return self.task.__await__()

    def __repr__(self) -> str:
        return f"BackgroundRun(state={self.state}, step={self.session.step_count})"
