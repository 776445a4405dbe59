"""Prompt datasets: rows from the built-in task or from JSONL/Parquet files, validated, and a seeded
sampler whose position is part of every checkpoint.

A row is a dict with a prompt field (`data.prompt_key`) and any extra fields (e.g. `answer`), which
reach the reward function as keyword arguments. Malformed rows are skipped, counted and reported with
their row numbers; the run goes on with the good rows unless none are left.
"""
from __future__ import annotations

import gzip
import json
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RLBenchError

log = logging.getLogger(__name__)


class DatasetError(RLBenchError, ValueError):
    """No usable rows, or a file that cannot be read at all."""


# Fields the phases add to a batch. A dataset row may not use these names: its fields reach the reward
# function as keyword arguments and ride in the batch beside the phases' own, which they would overwrite
# (a `group` field would regroup GRPO's samples) or be overwritten by (a `response` field).
RESERVED_FIELDS = frozenset({"response", "group", "reward_error", "reward_parts", "advantage", "reward", "length",
                             "score"})
_PROGRESS_BYTES = 64 * 2**20  # files larger than this show a progress bar while they load


@dataclass
class RowProblem:
    row: int  # 1-based: the line of a JSONL file, the record of a JSON array or Parquet file
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
    """(numbered raw rows, problems) from a file, by its content rather than its name: Parquet ('PAR1'),
    gzip (then its content), a JSON array, or JSON lines; UTF-8 with or without a byte-order mark.

    JSON lines are read one at a time (not with pyarrow's JSON reader, which stops at the first bad line):
    every line that is not valid UTF-8 or JSON is a problem with its line number, and the rest load."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    with path.open("rb") as f:
        head = f.read(4)
    if head == b"PAR1":
        return _read_parquet(path)
    opener = gzip.open if head[:2] == b"\x1f\x8b" else open
    try:
        with opener(path, "rb") as f:
            return _read_json_text(f, path)
    except (OSError, EOFError) as e:  # a truncated or corrupt gzip stream
        raise DatasetError(f"cannot read {path}: {e}") from None


def _read_parquet(path: Path) -> tuple[list, list]:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common base worth naming
        raise DatasetError(f"cannot read {path} as Parquet: {e}") from None
    return list(enumerate(table.to_pylist(), start=1)), []


def _read_json_text(f, path: Path) -> tuple[list, list]:
    first = f.read(1 << 16)
    start = first.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if start == b"[":  # one JSON array of rows
        data = first + f.read()
        try:
            rows = json.loads(data.decode("utf-8-sig"))
        except (UnicodeDecodeError, ValueError) as e:
            raise DatasetError(f"{path} starts like a JSON array but is not one: {e}") from None
        return list(enumerate(rows, start=1)), []
    rows, problems = [], []
    total = path.stat().st_size
    bar = None
    if total > _PROGRESS_BYTES:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"reading {path.name}")
    stream = _lines(first, f)
    for lineno, raw in enumerate(stream, start=1):
        if bar is not None:
            bar.update(len(raw))
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark is not part of row 1
        if not raw.strip():
            continue
        try:
            rows.append((lineno, json.loads(raw.decode("utf-8"))))
        except UnicodeDecodeError as e:
            problems.append(RowProblem(lineno, f"not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8"))
        except json.JSONDecodeError as e:
            problems.append(RowProblem(lineno, f"not valid JSON ({e.msg})"))
    if bar is not None:
        bar.close()
    return rows, problems


def _lines(first: bytes, f):
    """The file's lines (bytes), `first` being what was already read of it."""
    pending = first
    for chunk in iter(lambda: f.read(1 << 20), b""):
        pending += chunk
        *done, pending = pending.split(b"\n")
        yield from done
    yield from pending.split(b"\n")


def validate_rows(numbered: list[tuple[int, object]], prompt_key: str, max_prompt_len: int,
                  count_tokens: Callable[[str], int], source: str,
                  problems: list[RowProblem] | None = None, max_chars_per_token: int | None = None) -> PromptDataset:
    """Keep rows with a non-empty string prompt of at most `max_prompt_len` tokens. With
    `max_chars_per_token` (the tokenizer's longest token), a prompt too long by its characters alone is
    refused without tokenising it (a 10 MB prompt costs nothing)."""
    problems = list(problems or [])
    good = []
    for n, row in numbered:
        checked = _check_row(row, prompt_key, max_prompt_len, count_tokens, max_chars_per_token)
        if isinstance(checked, ReservedField):
            raise DatasetError(f"{source}: row {n} {checked}")
        if isinstance(checked, str):
            problems.append(RowProblem(n, checked))
        else:
            good.append(checked)
    ds = PromptDataset(good, source, sorted(problems, key=lambda p: p.row))
    if problems:
        log.warning("%s", ds.report())
    if not good:
        raise DatasetError(f"{ds.report()} — no usable rows left; fix the file or data.prompt_key / "
                           "data.max_prompt_len")
    return ds


def given_rows(rows, prompt_key: str, max_prompt_len: int, count_tokens: Callable[[str], int], what: str,
               max_chars_per_token: int | None = None) -> list[dict]:
    """Rows a caller hands a phase directly (`sess.rollout(rows)`, `sess.evaluate(rows)`), checked as a file's
    rows are (their prompt under `prompt_key` or "prompt"), but strictly: a row a file would skip is an error
    here, every bad row named by its index, before any worker runs — the caller chose each one."""
    example = f"[{{'{prompt_key}': 'What is 2 + 3?'}}]"
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Iterable):
        raise DatasetError(f"{what} takes a list of rows, each a dict with a '{prompt_key}' string, e.g. {example}; "
                           f"got {type(rows).__name__}")
    rows = list(rows)
    if not rows:
        raise DatasetError(f"{what} got no rows: give at least one, e.g. {example}, or none (rows=None) for the "
                           "run's own prompts")
    good, bad = [], []
    for i, row in enumerate(rows):
        # "prompt" is what the phases read: a loaded row holds it beside prompt_key, and an edited one changed it
        key = "prompt" if isinstance(row, dict) and "prompt" in row else prompt_key
        checked = _check_row(row, key, max_prompt_len, count_tokens, max_chars_per_token)
        if isinstance(row, dict) and key not in row and key != "prompt":  # neither name: both are taken here
            checked = f"missing field '{prompt_key}' or 'prompt' (fields: {sorted(row)[:6]})"
        if isinstance(checked, str):  # a ReservedField too: its text says what to rename
            bad.append(f"rows[{i}]: {checked}")
        else:
            good.append(checked)
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise DatasetError(f"{what}: {'; '.join(bad[:3])}{more}. Each row is a dict with a '{prompt_key}' string of "
                           f"at most data.max_prompt_len={max_prompt_len} tokens, e.g. {example}")
    return good


class ReservedField(str):
    """`_check_row`'s answer for a row with a field the phases use themselves: an error even where a file's bad
    rows are skipped (the file must be changed, not a row dropped)."""


def _check_row(row, prompt_key: str, max_prompt_len: int, count_tokens: Callable[[str], int],
               max_chars_per_token: int | None) -> dict | str:
    """The row as the phases read it (its prompt under "prompt"), or why it cannot be used."""
    if not isinstance(row, dict):
        return f"expected a dict (a JSON object), got {type(row).__name__}"
    clash = sorted(RESERVED_FIELDS & set(row) - {prompt_key})
    if clash:
        return ReservedField(f"has a field named '{clash[0]}', which rlbench-nb's phases use for their own results "
                             f"(reserved: {sorted(RESERVED_FIELDS)}): rename it, e.g. to '{clash[0]}_'")
    if prompt_key not in row:
        return f"missing field '{prompt_key}' (fields: {sorted(row)[:6]})"
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        return f"'{prompt_key}' must be a string, got {type(prompt).__name__}"
    if not prompt.strip():
        return f"empty '{prompt_key}'"
    if max_chars_per_token and len(prompt) > max_prompt_len * max_chars_per_token:
        return f"prompt has {len(prompt)} characters: more than data.max_prompt_len={max_prompt_len} tokens can hold"
    try:
        prompt.encode("utf-8")
        n_tok = count_tokens(prompt)
    except (UnicodeError, TypeError, ValueError) as e:  # e.g. a lone surrogate such as "\\ud800"
        return f"prompt cannot be tokenised ({type(e).__name__}: {str(e)[:80]})"
    if n_tok > max_prompt_len:
        return f"prompt has {n_tok} tokens > data.max_prompt_len={max_prompt_len}"
    return {**row, "prompt": prompt} if prompt_key != "prompt" else row


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
