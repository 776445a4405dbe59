"""Notebook -> batch script: the notebook is the source of the script, never a second copy of the loop.

    rlbench-nb export notebooks/01_quickstart.ipynb -o train.py
    python train.py --help                     # the notebook's parameters, as flags
    python train.py --steps 500 algo.kl_coef=0.02

Cells by tag (the conventions people already use):
- `parameters` (papermill): simple assignments that become the script's flags, each with its default
  and type. Extra `key=value` arguments are collected into the parameter named `overrides` if the
  notebook has one (config overrides pass straight through).
- `interactive`, `remove-cell`, `remove_cell`, `export-skip`: dropped (dashboards, inspectors, plots).
- everything else: kept, in order, inside `main()`.

The exporter parses cells but never executes them. IPython magics in kept cells are an error naming the
cell and line, except `%load_ext ...` and `%matplotlib ...`, which are dropped. `display(x)` prints `x`.
Top-level `await` makes `main()` run an `async` body with `asyncio.run`.
"""
from __future__ import annotations

import ast
import io
import json
import tokenize
from dataclasses import dataclass
from pathlib import Path

from .errors import RLBenchError

DROP_TAGS = {"interactive", "remove-cell", "remove_cell", "export-skip"}
DROPPED_MAGICS = ("%load_ext", "%matplotlib", "%config")


class ExportError(RLBenchError, ValueError):
    """The notebook cannot become a script; the message names the cell (index and first line)."""


@dataclass
class Cell:
    index: int
    kind: str
    source: str
    tags: set[str]

    @property
    def first_line(self) -> str:
        return next((line for line in self.source.splitlines() if line.strip()), "")[:60]

    def where(self) -> str:
        return f"cell {self.index} ({self.first_line!r})"


@dataclass
class Parameter:
    name: str
    default: object
    source: str  # the assignment as written


def read_cells(path: str | Path) -> list[Cell]:
    path = Path(path)
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not a notebook: invalid JSON ({e})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list) or "nbformat" not in nb:
        raise ExportError(f"{path} is not a notebook: no 'cells' list / 'nbformat' field")
    cells = []
    for i, c in enumerate(nb["cells"]):
        src = c.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        cells.append(Cell(i, c.get("cell_type", "code"), src, set(c.get("metadata", {}).get("tags", []))))
    return cells


def _strip_magics(cell: Cell) -> str:
    """Drop the few magics with a script meaning of 'nothing'; any other magic or shell line is an error."""
    out = []
    for n, line in enumerate(cell.source.splitlines(), start=1):
        s = line.strip()
        if s.startswith(DROPPED_MAGICS):
            out.append("")  # keep line numbers stable
            continue
        if s.startswith(("%", "!")):
            raise ExportError(f"{cell.where()}, line {n}: IPython syntax {s!r} has no plain-Python form; "
                              "move it to a cell tagged 'interactive' or rewrite it in Python")
        out.append(line)
    return "\n".join(out)


def _parse(cell: Cell, code: str) -> ast.Module:
    try:  # top-level await is legal in a notebook cell
        return compile(code, f"<cell {cell.index}>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as e:
        raise ExportError(f"{cell.where()}: syntax error on line {e.lineno}: {e.msg}") from None


def _has_top_level_await(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
            return True
    return False


def parse_parameters(cell: Cell) -> list[Parameter]:
    tree = _parse(cell, cell.source)
    params = []
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(target, ast.Name) or value is None:
            line = ast.get_source_segment(cell.source, node) or ""
            raise ExportError(f"{cell.where()}: the parameters cell may hold only simple assignments "
                              f"(name = literal); found {line.splitlines()[0]!r}")
        try:
            default = ast.literal_eval(value)
        except ValueError:
            raise ExportError(f"{cell.where()}: parameter '{target.id}' must be a literal (number, string, "
                              f"bool, None, list), got {ast.get_source_segment(cell.source, value)!r}") from None
        params.append(Parameter(target.id, default, ast.get_source_segment(cell.source, node)))
    return params


def _indent(code: str, prefix: str = "    ") -> str:
    """Indent code without touching the continuation lines of multi-line strings."""
    inside: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except tokenize.TokenError:
        pass
    return "\n".join(line if (n in inside or not line.strip()) else prefix + line
                     for n, line in enumerate(code.splitlines(), start=1))


def _plan(cells: list[Cell]) -> tuple[Cell | None, list[Cell], list[Cell]]:
    code = [c for c in cells if c.kind == "code"]
    params = [c for c in code if "parameters" in c.tags]
    if len(params) > 1:
        raise ExportError(f"two parameters cells: {params[0].where()} and {params[1].where()}; keep one")
    kept = [c for c in code if not (c.tags & DROP_TAGS) and "parameters" not in c.tags and c.source.strip()]
    dropped = [c for c in code if c.tags & DROP_TAGS]
    return (params[0] if params else None), kept, dropped


def _flag_type(value) -> str:
    if value is None:
        return "_optional"
    return {bool: "_bool", int: "int", float: "float", str: "str"}.get(type(value), "json.loads")


def to_script(path: str | Path) -> str:
    """The notebook at `path` as a runnable script (a string)."""
    path = Path(path)
    pcell, kept, dropped = _plan(read_cells(path))
    params = parse_parameters(pcell) if pcell else []
    bodies, is_async = [], False
    for cell in kept:
        code = _strip_magics(cell)
        is_async |= _has_top_level_await(_parse(cell, code))
        bodies.append(f"# ---- cell {cell.index}\n{code}")
    names = [p.name for p in params]
    flags = []
    for p in params:
        if p.name == "overrides" and isinstance(p.default, list):
            flags.append(f"    parser.add_argument('overrides', nargs='*', default={p.default!r}, help='config "
                         "overrides key=value (default: %(default)s)')")
        else:
            flags.append(f"    parser.add_argument('--{p.name.replace('_', '-')}', dest={p.name!r}, "
                         f"type={_flag_type(p.default)}, default={p.default!r}, "
                         f"help='default: %(default)s')")
    header = (f'"""Exported from {path.as_posix()} by `rlbench-nb export` — edit the notebook, not this file.\n\n'
              f"Parameters: cell {pcell.index if pcell else '-'}; kept cells: {[c.index for c in kept]}; "
              f"dropped (interactive): {[c.index for c in dropped]}.\n"
              f'Run it with --help for the flags.\n"""')
    body = "\n\n".join(bodies) or "pass"
    setup = ("    args = _parse_args(argv)\n" +
             "".join(f"    {n} = args.{n}\n" for n in names))
    resume = ('"python " + sys.argv[0] + " --resume {run_dir}"' if "resume" in names
              else '"rl.Session.load(\'{run_dir}\') in Python"')
    if is_async:
        main = (f"async def _main_async(argv=None):\n{setup}\n{_indent(body)}\n\n\n"
                "def main(argv=None):\n    asyncio.run(_main_async(argv))\n")
    else:
        main = f"def main(argv=None):\n{setup}\n{_indent(body)}\n"
    return f'''{header}
import argparse
import asyncio
import json
import sys


def display(*objs, **_):
    """Notebook display() in a terminal: print each object's text form."""
    for obj in objs:
        print(obj)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {{text!r}}")


def _optional(text: str):
    """A parameter whose default is None: 'none'/'null' stay None, numbers become numbers, else text."""
    if text.lower() in ("none", "null", ""):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description={("Exported from " + path.name)!r})
{chr(10).join(flags) if flags else "    pass"}
    return parser.parse_args(argv)


{main}

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # a batch job stopped by hand: checkpoint the runs and say how to continue
        try:
            from rlbench_nb.cli import save_live_sessions
        except ImportError:
            raise SystemExit(130) from None
        save_live_sessions({resume})
'''


def to_percent(path: str | Path) -> str:
    """jupytext's py:percent format: every cell, tags kept, so the file opens as a notebook again. Magics
    and shell lines are commented out as jupytext does (`# %load_ext x`), so the file stays valid Python."""
    out = ["# ---\n# jupyter:\n#   jupytext:\n#     formats: ipynb,py:percent\n# ---\n"]
    for c in read_cells(path):
        meta = f" tags={json.dumps(sorted(c.tags))}" if c.tags else ""
        if c.kind == "markdown":
            text = "\n".join("# " + line if line else "#" for line in c.source.splitlines())
            out.append(f"# %% [markdown]{meta}\n{text}\n")
        elif c.kind == "code":
            code = "\n".join("# " + line if line.lstrip().startswith(("%", "!")) else line
                             for line in c.source.splitlines())
            out.append(f"# %%{meta}\n{code}\n")
    return "\n".join(out)


def export(path: str | Path, output: str | Path, fmt: str = "script") -> Path:
    """Write the script (`fmt='script'`) or the py:percent twin (`fmt='py:percent'`) to `output`."""
    if fmt not in ("script", "py:percent"):
        raise ExportError(f"unknown format {fmt!r}; use 'script' or 'py:percent'")
    text = to_script(path) if fmt == "script" else to_percent(path)
    output = Path(output)
    output.write_text(text, encoding="utf-8")
    return output
