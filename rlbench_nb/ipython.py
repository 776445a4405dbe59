"""IPython extension: `%load_ext rlbench_nb`.

- Worker errors display role, rank, method and the failing user line first, then the worker's own
  traceback, instead of a wall of Ray internals.
- `%rl` magic: `%rl status` (live sessions: state, step, roles), `%rl attach NAME [ADDRESS]` (re-attach
  to a detached run; binds it to `sess`).
"""
from __future__ import annotations

from .cluster.errors import WorkerError
from .session import Session, live_sessions


def format_worker_error(err: WorkerError) -> str:
    lines = [f"{type(err).__name__}: {err.role} rank {err.rank} failed in {err.method}()",
             f"  {err.summary}"]
    if err.frame:
        lines.append(f"  at {err.frame}")
    if err.remote_traceback:
        lines += ["", "worker traceback:", err.remote_traceback.rstrip()]
    return "\n".join(lines)


def _show_worker_error(shell, etype, value, tb, tb_offset=None):
    print(format_worker_error(value))
    return None


def rl_magic(line: str, shell=None) -> object:
    args = line.split()
    if not args or args[0] == "status":
        sessions = live_sessions()
        if not sessions:
            return "no live rlbench-nb sessions"
        return "\n\n".join(repr(s) for s in sessions)
    if args[0] == "attach" and len(args) in (2, 3):
        sess = Session.attach(args[1], *(args[2:]))
        if shell is not None:
            shell.user_ns["sess"] = sess
        return sess
    return "usage: %rl status | %rl attach NAME [ADDRESS]"


def load_ipython_extension(ip) -> None:
    ip.set_custom_exc((WorkerError,), _show_worker_error)
    ip.register_magic_function(lambda line: rl_magic(line, ip), magic_kind="line", magic_name="rl")


def unload_ipython_extension(ip) -> None:
    ip.set_custom_exc((), None)
