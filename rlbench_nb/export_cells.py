"""A notebook read for export: its cells with their tags, the parameters cell's assignments, which cells are
kept, and the checks every export format shares (magics, syntax, top-level await). export.py writes a script or
a py:percent twin from them, export_marimo.py a marimo notebook.
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
    """The notebook's cells; an older format (nbformat 3: worksheets, `input`) is upgraded by nbformat."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        nb = json.loads(text)
    except FileNotFoundError:
        raise ExportError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not a notebook: invalid JSON ({e})") from None
    if isinstance(nb, dict) and nb.get("nbformat", 4) < 4 and isinstance(nb.get("worksheets"), list):
        import nbformat
        try:
            nb = json.loads(nbformat.writes(nbformat.reads(text, as_version=4)))
        except Exception as e:  # nbformat's own validation and conversion errors
            version = nb.get("nbformat")
            raise ExportError(f"{path}: nbformat cannot upgrade this version {version} notebook ({e})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list) or "nbformat" not in nb:
        raise ExportError(f"{path} is not a notebook: no 'cells' list / 'nbformat' field")
    cells = []
    for i, c in enumerate(nb["cells"]):
        src = c.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        cells.append(Cell(i, c.get("cell_type", "code"), src, set(c.get("metadata", {}).get("tags", []))))
    return cells


def strip_magics(cell: Cell) -> str:
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


def parse_cell(cell: Cell, code: str) -> ast.Module:
    try:  # top-level await is legal in a notebook cell
        return compile(code, f"<cell {cell.index}>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as e:
        raise ExportError(f"{cell.where()}: syntax error on line {e.lineno}: {e.msg}") from None


def has_top_level_await(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
            return True
    return False


def parse_parameters(cell: Cell) -> list[Parameter]:
    """The parameters cell's assignments, one per name (a name assigned twice keeps its last value, as the
    notebook would); `help` is refused (it is the script's --help)."""
    tree = parse_cell(cell, cell.source)
    params: dict[str, Parameter] = {}
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
        if target.id == "help":
            raise ExportError(f"{cell.where()}, line {node.lineno}: a parameter named 'help' would be the script's "
                              "--help flag; rename it")
        params.pop(target.id, None)  # the last assignment is the one the notebook runs with
        params[target.id] = Parameter(target.id, default, ast.get_source_segment(cell.source, node))
    return list(params.values())


def indent(code: str, prefix: str = "    ") -> str:
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


def plan_cells(cells: list[Cell]) -> tuple[Cell | None, list[Cell], list[Cell]]:
    code = [c for c in cells if c.kind == "code"]
    params = [c for c in code if "parameters" in c.tags]
    if len(params) > 1:
        raise ExportError(f"two parameters cells: {params[0].where()} and {params[1].where()}; keep one")
    kept = [c for c in code if not (c.tags & DROP_TAGS) and "parameters" not in c.tags and c.source.strip()]
    dropped = [c for c in code if c.tags & DROP_TAGS]
    return (params[0] if params else None), kept, dropped


def flag_type(value) -> str:
    if value is None:
        return "_optional"
    return {bool: "_bool", int: "int", float: "float", str: "str"}.get(type(value), "json.loads")


def flag_line(p: Parameter) -> str:
    """The argparse line of one parameter (`parser` is the script's ArgumentParser); `overrides`, a list, takes
    the key=value arguments."""
    if p.name == "overrides" and isinstance(p.default, list):
        return (f"    parser.add_argument('overrides', nargs='*', default={p.default!r}, help='config "
                "overrides key=value (default: %(default)s)')")
    return (f"    parser.add_argument('--{p.name.replace('_', '-')}', dest={p.name!r}, "
            f"type={flag_type(p.default)}, default={p.default!r}, help='default: %(default)s')")
