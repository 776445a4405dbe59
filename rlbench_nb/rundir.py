"""The run directory: where everything a run writes goes (nothing else is written outside it but caches).

    runs/<run.name>/
      config.yaml               the resolved config
      metrics.jsonl, tb/        one row per step (and per evaluation), TensorBoard events
      controller_state.json     step, data position, KL controller, evals: rewritten after every step
      rollouts/step_N.jsonl     samples every run.save_rollouts_every steps
      checkpoints/<name>/       + checkpoints/latest
      summary.json              what the last run() ended with
      owner.json                the lease: which controller writes this run (see `Lease`)
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

from .config import Config
from .data.batch import Batch
from .errors import RLBenchError, RunDirError, SessionStateError, write_failure

LEASE_TTL_S = 900.0  # a holder on another machine that has not renewed for this long is taken as gone


class RunInUseError(RLBenchError, RuntimeError):
    """Another live controller holds the run directory's lease."""




def fresh_run_dir(cfg: Config) -> Path:
    """<run.dir>/<run.name>, with a -2, -3, ... suffix when that exists: a new run never writes into an old one."""
    base = Path(cfg.run.dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()  # recorded absolute: a later cwd (a notebook's folder) changes nothing
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_config(self, cfg: Config) -> None:
        cfg.save(self.path / "config.yaml")

    def write_state(self, state: dict) -> None:
        """controller_state.json, replaced atomically: what `Session.attach` reads after a controller dies."""
        write_json(self.path / "controller_state.json", state)

    def read_state(self) -> dict:
        return json.loads((self.path / "controller_state.json").read_text())

    def write_summary(self, summary: dict) -> None:
        write_json(self.path / "summary.json", summary, indent=2)

    def write_rollouts(self, batch: Batch, step: int) -> Path:
        """rollouts/step_N.jsonl: one sample per line, with the names people see (`Batch.shown_fields`)."""
        d = self.path / "rollouts"
        d.mkdir(exist_ok=True)
        path = d / f"step_{step:06d}.jsonl"
        fields = batch.shown_fields() | ({"group": "group"} if "group" in batch else {})
        with path.open("w", encoding="utf-8") as f:
            for row in batch.rows(fields):
                f.write(json.dumps(row, default=str) + "\n")
        return path


def write_json(path: Path, data: dict, indent: int | None = None) -> None:
    """Replace a small JSON file atomically (write a sibling, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=indent))
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunDirError(e.errno, write_failure(path, e)) from None


# ---- one owner per run -----------------------------------------------------------------------------
def _process_start(pid: int) -> str | None:
    """The process's start time (Linux /proc): tells a live holder from a new process that reused its pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Lease:
    """Which controller writes a run directory: RUN_DIR/owner.json names it (token, host, pid, process
    start time) and is renewed after every step. A second controller — a re-run notebook cell, another
    kernel attaching the same detached run, `Session.load` of a run that is still training — is refused
    while the holder lives, unless it takes over (`take_over=True`); the old holder then finds the lease
    gone at its next step and stops writing. A holder on this machine is alive while its process is; one
    elsewhere, while it renewed within LEASE_TTL_S."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "owner.json"
        self.token = uuid.uuid4().hex
        self.me = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                   "start": _process_start(os.getpid()), "dir": str(run_dir)}

    def holder(self) -> dict | None:
        """The recorded holder, or None (no lease, an unreadable one, or one copied along with the run
        from another directory: it holds that directory, not this one)."""
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return holder if holder.get("dir") == self.me["dir"] else None

    @staticmethod
    def alive(holder: dict) -> bool:
        if holder.get("host") == socket.gethostname():
            return _process_start(holder.get("pid", -1)) == holder.get("start") is not None
        return time.time() - holder.get("renewed", 0) < LEASE_TTL_S

    @staticmethod
    def describe(holder: dict) -> str:
        here = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
        who = "another session in this process" if here else f"process {holder.get('pid')} on {holder.get('host')}"
        return f"{who} (since {time.strftime('%H:%M:%S', time.localtime(holder.get('since', 0)))})"

    def acquire(self, take_over: bool = False) -> None:
        holder = self.holder()
        if holder and holder.get("token") != self.token and self.alive(holder) and not take_over:
            raise RunInUseError(f"run directory {self.path.parent} is in use by {self.describe(holder)}: close "
                                "that session first (sess.close()), or pass take_over=True to take the run over "
                                "(the other session then stops writing it)")
        self.renew(since=time.time())

    def renew(self, since: float | None = None) -> None:
        held = self.holder() or {}
        write_json(self.path, {**self.me, "since": since or held.get("since", time.time()), "renewed": time.time()})

    def check(self, what: str) -> None:
        """Raise if another controller took the run over: this one must not write it any more."""
        holder = self.holder()
        if holder is not None and holder.get("token") != self.token:
            raise SessionStateError(f"cannot {what}: run directory {self.path.parent} was taken over by "
                                    f"{self.describe(holder)}; this session no longer writes it — close it")

    def release(self) -> None:
        holder = self.holder()
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)
