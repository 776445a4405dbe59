"""Notebook -> marimo notebook: `rlbench-nb export NB --format marimo -o nb.py` writes a file that opens in
`marimo edit` and runs as a script (`python nb.py --steps 500`), the parameters cell's assignments as its
flags, as in the batch script (export.py).

marimo runs cells by their data flow: a cell's arguments are the names it reads from other cells, its return
the names it defines, and **each name is defined by one cell only**. A notebook often binds a name again
further down (`batch = sess.rollout()` ... `batch = sess.score(batch)`); that stretch of cells becomes one
marimo cell, its code as written, with a comment saying why (marimo's own `marimo convert` renames the later
bindings instead, which changes code the user wrote). Cells in between go with it, since they may read the
first binding. A name starting with `_` is private to its cell under marimo, so a stretch that shares one is
merged too. Cells with no data between them (`sess.step()` then `sess.report()`) run in file order, as marimo
breaks ties by it. Dropped as in the script: cells tagged interactive (ipywidgets dashboards do not render
under marimo); markdown cells become `mo.md(...)` cells.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
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

MARIMO_FORMAT = "0.25.2"  # the marimo whose file format this writes (tests run `marimo check` where it is installed)


@dataclass
class Unit:
    """One marimo cell to be: code (or markdown) and the notebook cells it came from."""
    cells: list[int]
    code: str = ""
    markdown: str = ""
    defines: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)


class _Names(ast.NodeVisitor):
    """The names a cell binds at its top level (what marimo calls its definitions) and every name it reads."""

    def __init__(self):
        self.defines: set[str] = set()
        self.reads: set[str] = set()
        self.depth = 0  # inside a function, class, lambda or comprehension: bindings there are local

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.reads.add(node.id)
        elif self.depth == 0:
            self.defines.add(node.id)

    def _scope(self, node, name: str | None = None):
        if name and self.depth == 0:
            self.defines.add(name)
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_FunctionDef(self, node):
        self._scope(node, node.name)

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self._scope(node)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda

    def visit_Import(self, node):
        if self.depth == 0:
            self.defines.update((a.asname or a.name).split(".")[0] for a in node.names)

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node):
        if node.name and self.depth == 0:
            self.defines.add(node.name)
        self.generic_visit(node)


def _names(code: str) -> tuple[set[str], set[str]]:
    v = _Names()
    v.visit(ast.parse(code))
    return v.defines, v.reads


def _check(cell: Cell, tree: ast.Module) -> None:
    """What has no marimo meaning, refused with the cell and line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            raise ExportError(f"{cell.where()}, line {node.lineno}: marimo cannot see what `from {node.module} "
                              "import *` defines; import the names you use")
        if isinstance(node, ast.Global):
            raise ExportError(f"{cell.where()}, line {node.lineno}: `global` has no meaning in a marimo cell; "
                              "return the value instead")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "input":
            raise ExportError(f"{cell.where()}, line {node.lineno}: input() waits for someone to type, which a "
                              "marimo script cannot: make the answer a parameter (the parameters cell)")


def _parameters_code(params: list[Parameter], embedded: dict, notebook: str) -> str:
    """The parameters cell as code: argparse inside a function, so its imports and helpers stay out of the
    notebook's names (each marimo name has one owner); then one plain assignment a parameter."""
    helpers = "\n\n".join(inspect.getsource(f).rstrip() for f in HELPERS if f.__name__ != "display")
    flags = "\n".join(flag_line(p) for p in params)
    values = ", ".join(f"{p.name!r}: _embedded(cli.{p.name})" if isinstance(p.default, str) and p.default in embedded
                       else f"{p.name!r}: cli.{p.name}" for p in params)
    body = (f"import argparse\nimport hashlib\nimport json\nimport os\nimport tempfile\nfrom pathlib import Path\n\n"
            f"_EMBEDDED = {embedded!r}\n\n{helpers}\n\n"
            f"parser = argparse.ArgumentParser(description={('Exported from ' + notebook)!r})\n"
            f"{textwrap.dedent(flags)}\ncli = parser.parse_args()\nreturn {{{values}}}")
    return ("def _parameters():\n    \"\"\"The flags: `python this.py --steps 500`; under marimo, `marimo edit this.py "
            f"-- --steps 500`.\"\"\"\n{indent(body)}\n\n\n_values = _parameters()\n"
            + "".join(f"{p.name} = _values[{p.name!r}]\n" for p in params))


def _units(path: Path) -> tuple[list[Unit], Cell | None, list[Cell]]:
    cells = read_cells(path)
    pcell, kept, dropped = plan_cells(cells)
    units = []
    if pcell is not None:
        params, embedded = resolve_files(parse_parameters(pcell), path.resolve().parent)
        units.append(Unit([pcell.index], _parameters_code(params, embedded, path.name)))
    kept_ids = {c.index for c in kept}
    for cell in cells:
        if cell.kind == "markdown" and cell.source.strip():
            units.append(Unit([cell.index], markdown=cell.source))
        elif cell.index in kept_ids:
            code = strip_magics(cell)
            _check(cell, parse_cell(cell, code))
            units.append(Unit([cell.index], code))
    for u in units:
        if u.code:
            u.defines, u.reads = _names(u.code)
    return units, pcell, dropped


def _stretch(units: list[Unit]) -> tuple[int, int] | None:
    """The first stretch of units that must be one marimo cell: from a name's first binding to its last, or for
    a `_name` (private to its cell under marimo) to its last read; None when every name has one owner."""
    where: dict[str, list[int]] = {}
    for i, u in enumerate(units):
        for name in u.defines | {n for n in u.reads if n.startswith("_")}:
            where.setdefault(name, []).append(i)
    for name, found in where.items():
        owners = [i for i in found if name in units[i].defines]
        if name.startswith("_"):  # a cell with its own `_i` needs nobody; one reading another's does
            readers = [i for i in found if i not in owners]
            if owners and readers:
                return min(owners + readers), max(owners + readers)
        elif len(owners) > 1:
            return min(owners), max(owners)
    return None


def _merge_rebindings(units: list[Unit]) -> list[Unit]:
    """Merge stretches (`_stretch`) until each name has one owner."""
    while (span := _stretch(units)) is not None:
        a, b = span
        group = units[a:b + 1]
        code = "\n\n".join(u.code if u.code else indent(u.markdown, "# ") for u in group)
        merged = Unit(sum((u.cells for u in group), []), code)
        merged.defines, merged.reads = _names(code)
        units = units[:a] + [merged] + units[b + 1:]
    return units


def _cell(u: Unit, defined_elsewhere: set[str]) -> str:
    if u.markdown:
        text = u.markdown.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
        return f'@app.cell(hide_code=True)\ndef _(mo):\n    mo.md("""\n{indent(text)}\n    """)\n    return\n'
    args = sorted((u.reads - u.defines) & defined_elsewhere)
    public = sorted(n for n in u.defines if not n.startswith("_"))
    ret = f"return ({', '.join(public)},)" if public else "return"
    why = (f"# notebook cells {u.cells[0]}-{u.cells[-1]} as one marimo cell: marimo allows one definition of a "
           "name, and these cells bind one again\n" if len(u.cells) > 1 else "")
    head = "async def" if has_top_level_await(ast.parse(u.code)) else "def"
    return f"@app.cell\n{head} _({', '.join(args)}):\n{indent(why + u.code)}\n    {ret}\n"


def to_marimo(path: str | Path) -> str:
    """The notebook at `path` as a marimo notebook (a string), runnable with `python` and `marimo edit`."""
    path = Path(path)
    units, pcell, dropped = _units(path)
    units = _merge_rebindings(units)
    reads = set().union(*(u.reads for u in units)) if units else set()
    prelude = [Unit([], "import marimo as mo", defines={"mo"})]
    if "display" in reads and not any("display" in u.defines for u in units):
        prelude.append(Unit([], "def display(*objs, **_):\n    \"\"\"Jupyter's display(): the cell's output under "
                                "marimo, printed when run as a script.\"\"\"\n    for obj in objs:\n"
                                "        mo.output.append(obj) if mo.running_in_notebook() else print(obj)",
                            defines={"display"}, reads={"mo"}))
    units = prelude + units
    defined = set().union(*(u.defines for u in units))
    cells = "\n\n".join(_cell(u, defined) for u in units)
    header = (f'"""Exported from {path.as_posix()} by `rlbench-nb export --format marimo` — edit the notebook, '
              f"not this file.\n\nParameters: cell {pcell.index if pcell else '-'} (flags: --help); dropped "
              f"(interactive): {[c.index for c in dropped]}. Run: python {path.stem}.py, or marimo edit.\n\"\"\"")
    return (f"{header}\nimport marimo\n\n__generated_with = {MARIMO_FORMAT!r}\napp = marimo.App()\n\n\n{cells}\n\n"
            'if __name__ == "__main__":\n    app.run()\n')
