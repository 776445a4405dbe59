"""Experiment trackers people already use, as metric sinks (`run.trackers: [wandb, mlflow]`): each step's
row, the config as the run's parameters, and a table of rollout samples every `run.save_rollouts_every`
steps. Both are optional installs; neither needs a network:

- W&B (`pip install rlbench-nb[wandb]`): offline unless `WANDB_MODE` says otherwise; files in
  RUN_DIR/wandb/ (`wandb sync RUN_DIR/wandb/offline-run-*` uploads them later). The W&B run id is kept in
  RUN_DIR/wandb_id, so a session attached or loaded into the same run directory continues the same run.
- MLflow (`pip install rlbench-nb[mlflow]`): `MLFLOW_TRACKING_URI` when set, else a file store in
  RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns`). The MLflow run id is kept in
  RUN_DIR/mlflow_id likewise.

A tracker that fails to write (a full disk, a server gone) is logged and dropped for the rest of the
session: metrics.jsonl is the record, and training never stops for a tracker.
"""
from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path

SAMPLE_COLUMNS = ("step", "prompt", "response", "reward", "length", "advantage")


def make_trackers(names, run_dir: Path, cfg) -> list:
    return [{"wandb": WandbSink, "mlflow": MLflowSink}[n](Path(run_dir), cfg) for n in names]


def numbers(row: dict) -> dict[str, float]:
    """The row's finite numbers (trackers take scalars only; NaN stays in metrics.jsonl as null)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def sample_rows(step: int, rows: list[dict], limit: int) -> list[list]:
    """`limit` samples spread evenly over the batch (one per group when there are as many groups), as table
    rows (SAMPLE_COLUMNS)."""
    picked = rows[:: max(1, len(rows) // max(limit, 1))][:limit]
    return [[step, *(r.get(c) for c in SAMPLE_COLUMNS[1:])] for r in picked]


def _run_id(path: Path, new) -> str:
    """The id kept in `path`, or a new one written there: one tracker run per run directory."""
    if path.exists():
        return path.read_text().strip()
    rid = new()
    path.write_text(rid)
    return rid


def flat(d: dict, prefix: str = "") -> dict[str, str]:
    """{"algo": {"kl_coef": 0.0}} -> {"algo.kl_coef": "0.0"}: the config as MLflow parameters."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, f"{key}."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list) else str(v)
    return out


class WandbSink:
    def __init__(self, run_dir: Path, cfg):
        import wandb
        self._wandb = wandb
        rid = _run_id(run_dir / "wandb_id", lambda: uuid.uuid4().hex[:12])
        self.run = wandb.init(project=cfg.run.tracker_project, name=cfg.run.name, id=rid, resume="allow",
                              dir=str(run_dir), config=cfg.to_dict(), mode=os.environ.get("WANDB_MODE", "offline"),
                              reinit="create_new", settings=wandb.Settings(silent=True, console="off"))

    def write(self, step: int, row: dict) -> None:
        self.run.log(numbers(row), step=step)

    def write_samples(self, step: int, rows: list[dict], limit: int) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(step, rows, limit))
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowSink:
    def __init__(self, run_dir: Path, cfg):
        from mlflow import MlflowClient
        from mlflow.entities import Param
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the local file store MLflow keeps in maintenance mode: opted into for this default only
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = c = MlflowClient(tracking_uri=uri)
        name = cfg.run.tracker_project
        exp = c.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else c.create_experiment(name)
        new = not (run_dir / "mlflow_id").exists()
        self.run_id = _run_id(run_dir / "mlflow_id", lambda: c.create_run(exp_id, run_name=cfg.run.name).info.run_id)
        if new:
            params = [Param(k, v[:6000]) for k, v in flat(cfg.to_dict()).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                c.log_batch(self.run_id, params=params[i:i + 100])
        else:
            c.update_run(self.run_id, status="RUNNING")

    def write(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in numbers(row).items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def write_samples(self, step: int, rows: list[dict], limit: int) -> None:
        # the JSON MLflow's own log_table writes ({"columns", "data"}), without its pandas dependency
        self.client.log_dict(self.run_id, {"columns": list(SAMPLE_COLUMNS), "data": sample_rows(step, rows, limit)},
                             f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
