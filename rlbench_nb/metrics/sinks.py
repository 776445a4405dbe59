"""Metric sinks: where each step's row of metrics goes. A sink has `write(step, row)` and `close()`."""
from __future__ import annotations

import json
import math
from pathlib import Path


class JSONLSink:
    """One JSON object per step, flushed at once: a crash loses no row already written. A file whose last
    line was torn (a crash, or a full disk, mid-row) gets a line break first, so the torn row stays on its
    own line (readers skip it) instead of swallowing the next one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        torn = self.path.exists() and self.path.stat().st_size > 0 and _last_byte(self.path) != b"\n"
        self._f = self.path.open("a", encoding="utf-8")
        if torn:
            self._f.write("\n")

    def write(self, step: int, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps({"step": step, **clean}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    """Scalars into TensorBoard event files (`tensorboard --logdir RUN_DIR/tb`)."""

    def __init__(self, logdir: str | Path):
        from torch.utils.tensorboard import SummaryWriter
        self._w = SummaryWriter(str(logdir))

    def write(self, step: int, row: dict) -> None:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a metrics file; a torn last line (a crash mid-write) is ignored."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
