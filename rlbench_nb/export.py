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

The script runs from any folder (a cluster job's working directory, a colleague's checkout): a parameter
naming a YAML file the notebook can reach (from its own folder or up to three above, as `Config.load`
looks) is embedded in the script, with the relative paths inside it (data, model, reward file) made
absolute; any other parameter naming an existing file or folder becomes its absolute path. Passing the
flag (`--config other.yaml`) still overrides. What a notebook means and a function body cannot, the export
either keeps meaning the same (`from x import *` moves to the module; names a cell's function declares
`global` are global in `main()` too; a parameter assigned twice keeps its last value, as in the notebook)
or refuses with the cell and line (`input()`, a parameter named `help`).
"""
from __future__ import annotations

import ast
import inspect
import json
from dataclasses import dataclass, replace
from pathlib import Path

from .export_cells import (
    Cell,
    ExportError,
    Parameter,
    flag_line,
    has_top_level_await,
    indent,
    parse_cell,
    parse_parameters,
    plan_cells,
    read_cells,
    strip_magics,
)
from .export_files import resolve_files
from .export_helpers import HELPERS
from .export_marimo import to_marimo


def _check_cell(cell: Cell, tree: ast.Module) -> tuple[list[ast.stmt], set[str]]:
    """What a cell needs at module level: its top-level `from x import *` lines (moved out of `main()`, where
    Python forbids them) and the names its functions declare `global` (global in `main()` too, so they
    mean the notebook's variables). Refuses what has no batch meaning, naming cell and line."""
    hoisted, global_names, top_globals = [], set(), []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            hoisted.append(node)
        elif isinstance(node, ast.Global):  # at a cell's top level: main() declares it first instead
            top_globals.append(node)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) and node not in hoisted:
            raise ExportError(f"{cell.where()}, line {node.lineno}: `from {node.module} import *` inside a block "
                              "cannot move into the script's main(); import the names you use")
        if isinstance(node, ast.Global):
            global_names.update(node.names)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "input":
            raise ExportError(f"{cell.where()}, line {node.lineno}: input() waits for someone to type, and a batch "
                              "run has no one: make the answer a parameter (the parameters cell), or tag the cell "
                              "'interactive'")
    return hoisted + top_globals, global_names


def _hoist(code: str, nodes: list[ast.stmt]) -> str:
    """`code` with the lines of these top-level statements blanked: line numbers stay."""
    out = code.splitlines()
    for node in nodes:
        for i in range(node.lineno - 1, node.end_lineno):
            out[i] = ""
    return "\n".join(out)



def to_script(path: str | Path) -> str:
    """The notebook at `path` as a runnable script (a string): a header saying where it came from, the
    imports, the helpers (export_helpers.py), the flags, and `main()` holding the kept cells in order."""
    path = Path(path)
    pcell, kept, dropped = plan_cells(read_cells(path))
    params, embedded = resolve_files(parse_parameters(pcell) if pcell else [], path.resolve().parent)
    cells = _main_cells(kept)
    names = [p.name for p in params]
    resume = ('"python " + sys.argv[0] + " --resume {run_dir}"' if "resume" in names
              else '"rl.Session.load(\'{run_dir}\') in Python"')
    stars = "".join(f"{line}  # from a cell: star imports live at module level\n" for line in cells.star_imports)
    helpers = "\n\n\n".join(inspect.getsource(f).rstrip() for f in HELPERS)
    flags = "\n".join(flag_line(p) for p in params) or "    pass"
    return f'''{_header(path, pcell, kept, dropped, embedded)}
import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
{stars}
_EMBEDDED = {embedded!r}


{helpers}


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description={("Exported from " + path.name)!r})
{flags}
    return parser.parse_args(argv)


{_main_function(cells, params, embedded)}

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


@dataclass
class MainCells:
    """The kept cells as `main()`'s body, and what they need of the script around it."""
    bodies: list[str]
    is_async: bool            # a cell awaits at top level: main() runs an async body
    star_imports: list[str]   # `from x import *` lines, moved to module level
    global_names: set[str]    # names a cell's function declares global: global in main() too


def _main_cells(kept: list[Cell]) -> MainCells:
    out = MainCells([], False, [], set())
    for cell in kept:
        code = strip_magics(cell)
        tree = parse_cell(cell, code)
        out.is_async |= has_top_level_await(tree)
        hoisted, names = _check_cell(replace(cell, source=code), tree)
        out.star_imports += [ast.get_source_segment(code, n) for n in hoisted if isinstance(n, ast.ImportFrom)]
        out.global_names |= names
        out.bodies.append(f"# ---- cell {cell.index}\n{_hoist(code, hoisted)}")
    return out



def _header(path: Path, pcell: Cell | None, kept: list[Cell], dropped: list[Cell], embedded: dict) -> str:
    return (f'"""Exported from {path.as_posix()} by `rlbench-nb export` — edit the notebook, not this file.\n\n'
            f"Parameters: cell {pcell.index if pcell else '-'}; kept cells: {[c.index for c in kept]}; "
            f"dropped (interactive): {[c.index for c in dropped]}.\n"
            + (f"Embedded at export (used unless the flag names another file): {sorted(embedded)}.\n"
               if embedded else "")
            + 'Run it with --help for the flags; it runs from any folder.\n"""')


def _main_function(cells: MainCells, params: list[Parameter], embedded: dict) -> str:
    """`main(_argv)`: the flags read into the notebook's parameter names, then the cells."""
    setup = ((f"    global {', '.join(sorted(cells.global_names))}  # declared global by a cell's function\n"
              if cells.global_names else "")
             + "    _cli = _parse_args(_argv)\n"
             + "".join(f"    {p.name} = _embedded(_cli.{p.name})\n" if isinstance(p.default, str)
                       and p.default in embedded else f"    {p.name} = _cli.{p.name}\n" for p in params))
    body = indent("\n\n".join(cells.bodies) or "pass")
    if cells.is_async:
        return (f"async def _main_async(_argv=None):\n{setup}\n{body}\n\n\n"
                "def main(_argv=None):\n    asyncio.run(_main_async(_argv))\n")
    return f"def main(_argv=None):\n{setup}\n{body}\n"


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


def export(path: str | Path, output: str | Path, fmt: str = "script", force: bool = False) -> Path:
    """Write the script (`fmt='script'`), the py:percent twin (`'py:percent'`) or a marimo notebook (`'marimo'`,
    export_marimo.py) to `output`. Never over the notebook itself, nor over a file that is not an earlier export
    of it unless `force`."""
    writers = {"script": to_script, "py:percent": to_percent, "marimo": to_marimo}
    if fmt not in writers:
        raise ExportError(f"unknown format {fmt!r}; use one of {', '.join(writers)}")
    output = Path(output)
    if output.suffix == ".ipynb" or (output.exists() and Path(path).exists() and output.samefile(path)):
        raise ExportError(f"-o {output} would overwrite a notebook: name a .py file")
    if output.exists() and not force and not _earlier_export(output, Path(path)):
        raise ExportError(f"{output} exists and is not an export of {Path(path).name}: choose another -o, or "
                          "--force to replace it")
    text = writers[fmt](path)
    output.write_text(text, encoding="utf-8")
    return output


def _earlier_export(output: Path, notebook: Path) -> bool:
    """Whether `output` is an earlier export of `notebook` (a script's first line names it) or a jupytext
    py:percent file."""
    try:
        with output.open(encoding="utf-8") as f:
            head = f.readline() + f.readline()
    except (OSError, UnicodeDecodeError):
        return False
    return (head.startswith('"""Exported from ') and f"{notebook.name} by `rlbench-nb export" in head.splitlines()[0]
            or head.startswith("# ---\n# jupyter:"))
