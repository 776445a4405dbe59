"""Published math datasets -> our prompt files (`rlbench-nb data gsm8k SRC -o DIR`, `... data math ...`).

SRC is what you downloaded yourself (nothing is fetched here): one file or a folder of them, in the schema
the dataset is published in —

- gsm8k: rows {question, answer} where answer is the worked solution ending "#### 72" (the Hugging Face
  Parquet files `main/{train,test}-*.parquet`, or the original `{train,test}.jsonl`);
- math: rows {problem, solution[, answer]} where the solution holds a `\\boxed{...}` (Hendrycks MATH as
  Parquet/JSONL, MATH-500's `test.jsonl`, or the original folder of one-problem JSON files per subject).

DIR gets `train.jsonl` and/or `test.jsonl` (split from the file names: "train" / "test"; anything else is
train), each row {"prompt", "answer", "solution"}: the prompt is the question with the instruction the
matching reward reads (`rewards.gsm8k`: "####", `rewards.boxed_math`: `\\boxed{}`), the answer is the bare
final answer. Rows without a usable answer are counted and skipped, never guessed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RLBenchError
from ..rewards.answers import boxed_answer, hashes_answer
from .datasets import DatasetError, RowProblem, read_rows

INSTRUCTIONS = {
    "gsm8k": "Let's think step by step and output the final answer after \"####\".",
    "math": "Let's think step by step and output the final answer within \\boxed{}.",
}
SUFFIXES = (".parquet", ".jsonl", ".json", ".jsonl.gz")


@dataclass
class Prepared:
    """What `prepare` wrote: rows per split, skipped rows with the reason, and the files."""
    files: dict[str, Path] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # "file:row: why", the first few are printed


def prepare(dataset: str, src: str | Path, out_dir: str | Path) -> Prepared:
    """Read every source file under `src`, convert its rows, write DIR/{train,test}.jsonl."""
    if dataset not in INSTRUCTIONS:
        raise RLBenchError(f"unknown dataset '{dataset}': choose one of {sorted(INSTRUCTIONS)}")
    files = _source_files(Path(src))
    splits: dict[str, list[dict]] = {}
    result = Prepared()
    for path in files:
        split = "test" if "test" in path.name.lower() or path.parent.name.lower() == "test" else "train"
        for where, raw in _rows(path):
            row, why = (None, raw.reason) if isinstance(raw, RowProblem) else \
                (_gsm8k_row if dataset == "gsm8k" else _math_row)(raw)
            if row is None:
                result.skipped.append(f"{where}: {why}")
                continue
            splits.setdefault(split, []).append(row)
    if not splits:
        raise RLBenchError(f"no usable {dataset} rows in {src} ({len(result.skipped)} skipped"
                           + (f"; first: {result.skipped[0]}" if result.skipped else "") + ")")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in sorted(splits.items()):
        path = out_dir / f"{split}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp.replace(path)  # a file half-written by an interrupted run never looks finished
        result.files[split], result.rows[split] = path, len(rows)
    return result


def _source_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise RLBenchError(f"{src} does not exist: give the dataset file or the folder you downloaded")
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.name.lower().endswith(SUFFIXES))
    if not files:
        raise RLBenchError(f"no {', '.join(SUFFIXES)} files under {src}")
    return files


def _rows(path: Path):
    """(where, raw row) for each row of a file; a pretty-printed one-problem JSON file (original MATH) is one."""
    if path.suffix == ".json":
        try:
            obj = json.loads(path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, ValueError) as e:
            raise DatasetError(f"cannot read {path}: {e}") from None
        if isinstance(obj, dict):
            yield f"{path}", obj
            return
    numbered, problems = read_rows(path)
    for p in problems:  # lines that are not JSON at all
        yield f"{path}:{p.row}", RowProblem(p.row, p.reason)
    for n, raw in numbered:
        yield f"{path}:{n}", raw


def _gsm8k_row(raw) -> tuple[dict | None, str]:
    if not isinstance(raw, dict) or not isinstance(raw.get("question"), str) or not isinstance(raw.get("answer"), str):
        return None, "not a row with 'question' and 'answer' strings (the GSM8K schema)"
    final = hashes_answer(raw["answer"])
    if not final:
        return None, "its answer has no '#### <number>' line"
    return {"prompt": f"{raw['question'].strip()} {INSTRUCTIONS['gsm8k']}", "answer": final.replace(",", ""),
            "solution": raw["answer"]}, ""


def _math_row(raw) -> tuple[dict | None, str]:
    if not isinstance(raw, dict) or not isinstance(raw.get("problem"), str):
        return None, "not a row with a 'problem' string (the MATH schema)"
    solution = raw.get("solution") if isinstance(raw.get("solution"), str) else ""
    final = raw.get("answer") if isinstance(raw.get("answer"), str) and raw["answer"].strip() else None
    final = final or boxed_answer(solution)
    if not final:
        return None, "no 'answer' field and no \\boxed{...} in its solution"
    return {"prompt": f"{raw['problem'].strip()} {INSTRUCTIONS['math']}", "answer": final.strip(),
            "solution": solution}, ""
