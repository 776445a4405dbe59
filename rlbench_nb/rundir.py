"""The run directory: where everything a run writes goes (nothing else is written outside it but caches).

    runs/<run.name>/
      config.yaml               the resolved config
      metrics.jsonl, tb/        one row per step (and per evaluation), TensorBoard events
      controller_state.json     step, data position, KL controller, evals: rewritten after every step
      rollouts/step_N.jsonl     samples every run.save_rollouts_every steps
      checkpoints/<name>/       + checkpoints/latest
      summary.json              what the last run() ended with
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .config import Config
from .data.batch import Batch


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
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)
