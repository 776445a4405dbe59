"""Checkpoint files: atomic writes, finding the latest, and aligning metrics with a restored step.

A checkpoint is a folder: config.yaml, controller.json (step, data position, KL controller, evals),
policy/ (model.safetensors + trainer_state.pt: optimizer and RNG, loaded with weights_only=True),
critic/ when PPO, rollout_state.pt. Nothing in it is unpickled as code.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Callable

from .metrics import read_jsonl

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    pass


def write_atomically(final: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling folder, then rename: a crash mid-save never leaves a half
    checkpoint under the final name, and the previous one stays loadable. Updates checkpoints/latest."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    (tmp / "COMPLETE").write_text("ok")
    if final.exists():
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    latest_tmp = final.parent / f".latest.tmp{os.getpid()}"
    latest_tmp.write_text(final.name)
    latest_tmp.replace(final.parent / "latest")


def load_tensors(path: Path, map_location=None):
    """torch.load with weights_only=True: tensors and plain containers only. A file that would run code
    when unpickled (or is not a torch file at all) is refused with the file named, and nothing runs."""
    import torch
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"refusing to load {path}: it is not a tensors-only file ({first}). Checkpoints "
                              "are loaded without executing pickled code; load an earlier checkpoint") from None


def write_json(path: Path, data: dict) -> None:
    """Replace a small JSON file atomically."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _newest_complete(folder: Path) -> Path | None:
    done = [p for p in folder.iterdir() if not p.name.startswith(".") and (p / "COMPLETE").exists()]
    return max(done, key=lambda p: json.loads((p / "controller.json").read_text())["step"], default=None)


def resolve(path: Path) -> Path:
    """A checkpoint folder from a checkpoint path, a checkpoints/ folder or a run directory (-> latest).

    If `latest` names a folder that is not there (a kill between moving an old checkpoint of the same
    name aside and renaming the new one in), the newest complete checkpoint is used instead."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / "latest").is_file():
            path = candidate / (candidate / "latest").read_text().strip()
            if not path.exists() and _newest_complete(candidate) is not None:
                log.warning("checkpoint %s named by latest is missing; using the newest complete one", path)
                path = _newest_complete(candidate)
            break
    if not (path / "controller.json").exists():
        raise CheckpointError(f"no checkpoint at {path} (expected controller.json; give a checkpoint folder "
                              "or a run directory with checkpoints/latest)")
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"checkpoint {path} is incomplete (interrupted save?); load an earlier one")
    return path


def truncate_metrics(metrics_path: Path, step: int) -> list[dict]:
    """Keep metrics rows up to `step` in metrics.jsonl (the resumed run rewrites the rest); rows past it
    move to metrics.superseded.jsonl so nothing written is lost. Returns the kept training rows."""
    rows = read_jsonl(metrics_path)
    keep = [r for r in rows if r.get("step", 0) <= step]
    later = [r for r in rows if r.get("step", 0) > step]
    if later:
        with (metrics_path.parent / "metrics.superseded.jsonl").open("a") as f:
            for r in later:
                f.write(json.dumps(r) + "\n")
        tmp = metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(metrics_path)
    return [r for r in keep if "reward/mean" in r]
