"""How a session shows itself: the live dashboard, the rollout inspector, its repr and its HTML in a
notebook. Methods written here and bound on `Session` (`dashboard = views.dashboard`); the widgets load
only when asked for (the controller runs without ipywidgets and plotly imported)."""
from __future__ import annotations

import os
from html import escape
from typing import TYPE_CHECKING

from .data.batch import Batch
from .errors import UsageError, is_count

if TYPE_CHECKING:
    from pathlib import Path

    from .session import Session


def dashboard(self: Session, max_points: int = 500):
    """Live widget: reward, accuracy, length, KL, entropy, losses, clipping, grad norm, throughput,
    memory, and a phase timeline; Pause / Resume / Stop buttons for background runs."""
    from .widgets import Dashboard
    if max_points is not None and not is_count(max_points, 2):
        raise UsageError(f"max_points={max_points!r}: how many points each curve keeps, 2 or more (default 500; "
                         "None: all)")
    return Dashboard(self, max_points=max_points)


def serve_tinker(self: Session, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
    """Serve this session over the Tinker API (rlbench_nb/serve/, docs/tinker.md): the `tinker` SDK and
    tinker-cookbook recipes train its policy and sample from its engines, in this kernel or another process."""
    from .serve import serve_tinker as start
    return start(self, host, port, api_key)


def inspect(self: Session, batch: Batch | str | Path | None = None):
    """Rollout inspector for a batch, or a saved rollouts file (default: the latest one of this run)."""
    from .widgets import Inspector
    if batch is None:
        files = sorted((self.run_dir / "rollouts").glob("step_*.jsonl"))
        if not files:
            raise UsageError("no batch given and no saved rollouts yet in this run (run.save_rollouts_every)")
        batch = files[-1]
    if not isinstance(batch, (Batch, str, os.PathLike)):
        raise UsageError(f"sess.inspect takes a batch (sess.rollout(), sess.score(...)) or a rollouts file, got "
                         f"{type(batch).__name__}")
    return Inspector(batch, tokenizer=self.tokenizer)


def describe(self: Session) -> str:
    lines = [f"Session(state={self.state}, step={self.step_count}, algo={self.cfg.algo.advantage}, "
             f"backend={self.cfg.cluster.backend}, run_dir={self.run_dir})"]
    lines += [f"  {r:<12} rank {k}  pool={pool} node={n} pid={p} device={d} rss_gb={m}"
              for r, k, pool, n, p, d, m in self.workers.table()]
    return "\n".join(lines)


def describe_html(self: Session) -> str:
    rows = "".join("<tr>" + "".join(f"<td>{escape(str(x))}</td>" for x in row) + "</tr>"
                   for row in self.workers.table())
    head = "".join(f"<th>{h}</th>" for h in ("role", "rank", "pool", "node", "pid", "device", "RSS GB"))
    return (f"<div><b>rlbench-nb Session</b> — state <b>{self.state}</b>, step {self.step_count}, "
            f"algo {self.cfg.algo.advantage}, backend {self.cfg.cluster.backend}<br>"
            f"<code>{escape(str(self.run_dir))}</code><table style='font-size:12px'><tr>{head}</tr>{rows}"
            "</table></div>")
