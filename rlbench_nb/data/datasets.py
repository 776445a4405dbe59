"""Prompt datasets: rows from the built-in task or from JSONL/Parquet files, validated, and a seeded
sampler whose position is part of every checkpoint.

A row is a dict with a prompt field (`data.prompt_key`) and any extra fields (e.g. `answer`), which
reach the reward function as keyword arguments. Malformed rows are skipped, counted and reported with
their row numbers; the run goes on with the good rows unless none are left.
"""
from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RLBenchError

log = logging.getLogger(__name__)


class DatasetError(RLBenchError, ValueError):
    """No usable rows, or a file that cannot be read at all."""


@dataclass
class RowProblem:
    row: int  # 1-based line number in a JSONL file, 0-based index otherwise
    reason: str


@dataclass
class PromptDataset:
    rows: list[dict]
    source: str
    problems: list[RowProblem] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def report(self) -> str:
        """One line saying how many rows were kept and which were skipped, and why."""
        if not self.problems:
            return f"{self.source}: {len(self.rows)} rows"
        shown = "; ".join(f"row {p.row}: {p.reason}" for p in self.problems[:5])
        more = f"; and {len(self.problems) - 5} more" if len(self.problems) > 5 else ""
        return f"{self.source}: {len(self.rows)} rows kept, {len(self.problems)} skipped ({shown}{more})"


def read_rows(path: str | Path) -> tuple[list[tuple[int, object]], list[RowProblem]]:
    """(numbered raw rows, problems) from a .jsonl/.json-lines or .parquet file. Bad JSON lines are problems."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        return list(enumerate(pq.read_table(path).to_pylist())), []
    rows, problems = [], []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                problems.append(RowProblem(lineno, f"not valid JSON ({e.msg})"))
    return rows, problems


def validate_rows(numbered: list[tuple[int, object]], prompt_key: str, max_prompt_len: int,
                  count_tokens: Callable[[str], int], source: str,
                  problems: list[RowProblem] | None = None) -> PromptDataset:
    """Keep rows with a non-empty string prompt of at most `max_prompt_len` tokens."""
    problems = list(problems or [])
    good = []
    for n, row in numbered:
        if not isinstance(row, dict):
            problems.append(RowProblem(n, f"expected a JSON object, got {type(row).__name__}"))
            continue
        if prompt_key not in row:
            problems.append(RowProblem(n, f"missing field '{prompt_key}' (fields: {sorted(row)[:6]})"))
            continue
        prompt = row[prompt_key]
        if not isinstance(prompt, str):
            problems.append(RowProblem(n, f"'{prompt_key}' must be a string, got {type(prompt).__name__}"))
            continue
        if not prompt.strip():
            problems.append(RowProblem(n, f"empty '{prompt_key}'"))
            continue
        n_tok = count_tokens(prompt)
        if n_tok > max_prompt_len:
            problems.append(RowProblem(n, f"prompt has {n_tok} tokens > data.max_prompt_len={max_prompt_len}"))
            continue
        good.append({**row, "prompt": prompt} if prompt_key != "prompt" else row)
    ds = PromptDataset(good, source, sorted(problems, key=lambda p: p.row))
    if problems:
        log.warning("%s", ds.report())
    if not good:
        raise DatasetError(f"{ds.report()} — no usable rows left; "
                           "fix the file or data.prompt_key / data.max_prompt_len")
    return ds


class PromptSampler:
    """Seeded epochs over N rows, `batch_size` indices at a time; its state goes into checkpoints."""

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True):
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next_indices(self) -> list[int]:
        out = []
        while len(out) < self.batch_size:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(self.batch_size - len(out), self.n - self.pos)
            out += self._order[self.pos: self.pos + take]
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._make_order()
