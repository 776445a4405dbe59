"""Notebook -> marimo notebook (rlbench_nb/export_marimo.py): each name one owner, flags, markdown, await,
refusals; every shipped notebook passes `marimo check`. The quickstart's marimo twin gives the notebook's run:
tests/test_export.py::test_notebook_and_exported_script_give_the_same_run."""
import ast
import shutil
import subprocess
import sys

import nbformat
import pytest

from rlbench_nb.export import ExportError, export
from rlbench_nb.export_marimo import to_marimo

from .conftest import REPO

marimo = pytest.importorskip("marimo", reason="marimo is in the test extra; pip install marimo")


def notebook(tmp_path, *cells):
    """cells: (source, *tags); a source starting with '#md ' is a markdown cell."""
    nb = nbformat.v4.new_notebook()
    for src, *tags in cells:
        c = nbformat.v4.new_markdown_cell(src[4:]) if src.startswith("#md ") else nbformat.v4.new_code_cell(src)
        c.metadata["tags"] = list(tags)
        nb.cells.append(c)
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    return path


def marimo_check(path):
    exe = shutil.which("marimo", path=str(REPO / ".venv/bin")) or shutil.which("marimo")
    out = subprocess.run([exe, "check", str(path)], capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout + out.stderr


def cells_of(text):
    """{first line of each @app.cell function's body: (its arguments, its return)} of a marimo file."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "_":
            ret = node.body[-1]
            names = sorted(ast.unparse(ret.value).strip("()").replace(" ", "").split(",")) if ret.value else []
            out[ast.unparse(node.body[0]).splitlines()[0]] = ([a.arg for a in node.args.args], [n for n in names if n])
    return out


def test_a_rebound_name_makes_one_cell_and_the_flags_and_markdown_survive(tmp_path):
    """`batch` bound in cells 2 and 4 (read in 3 between) becomes one marimo cell with 2-4 as written; the
    parameters are flags; markdown is a mo.md cell; a cell reading another's `_tmp` joins it; output is the
    notebook's order, as marimo breaks ties by file order."""
    nb = notebook(tmp_path,
                  ("steps = 3\nname = 'a'", "parameters"),
                  ("#md # Title with \"\"\"quotes\"\"\" and \\ backslash",),
                  ("batch = [steps]\nlog = []",),
                  ("log.append(len(batch))",),
                  ("batch = batch + [name]\nprint('batch', batch, log)",),
                  ("print('DASHBOARD')", "interactive"),
                  ("_tmp = 5",), ("print('tmp', _tmp)",),
                  ("import asyncio\nawait asyncio.sleep(0)\ndisplay({'steps': steps})",))
    out = export(nb, tmp_path / "m.py", "marimo")
    text = out.read_text()
    cells = cells_of(text)
    merged = next(k for k in cells if k.startswith("batch = [steps]"))
    assert cells[merged] == (["name", "steps"], ["batch", "log"])  # reads the flags, owns what it binds
    assert "notebook cells 2-4 as one marimo cell" in text and "log.append(len(batch))" in text
    assert "async def _(" in text and "DASHBOARD" not in text
    code, report = marimo_check(out)
    assert code == 0, report
    run = subprocess.run([sys.executable, str(out), "--steps", "7", "--name", "b"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["batch [7, 'b'] [1]", "tmp 5", "{'steps': 7}"]
    assert "--steps STEPS" in subprocess.run([sys.executable, str(out), "--help"], capture_output=True, text=True,
                                             timeout=120).stdout


@pytest.mark.parametrize("cells, message", [
    ((("from os.path import *\nx = join('a')",),), "import *"),
    ((("def f():\n    global x\n    x = 1",),), "`global`"),
    ((("answer = input('?')",),), "input()"),
    ((("%timeit x = 1",),), "IPython syntax"),
])
def test_what_marimo_cannot_mean_is_refused_with_its_cell(tmp_path, cells, message):
    with pytest.raises(ExportError, match="cell 0") as e:
        to_marimo(notebook(tmp_path, *cells))
    assert message in str(e.value)


def test_every_shipped_notebook_exports_to_marimo_and_passes_its_check(tmp_path):
    notebooks = sorted((REPO / "notebooks").glob("*.ipynb"))
    for nb in notebooks:
        out = export(nb, tmp_path / (nb.stem + ".py"), "marimo")
        code, report = marimo_check(out)
        assert code == 0 and "critical" not in report, f"{nb.name}: {report}"
    assert export(notebooks[0], tmp_path / (notebooks[0].stem + ".py"), "marimo")  # an earlier export is replaced
