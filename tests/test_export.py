"""Notebook -> script export: tags, flags, magics, await, round trip, bad input, and run parity."""
import json
import py_compile
import subprocess
import sys

import nbformat
import pytest

from rlbench_nb.export import ExportError, export, to_percent, to_script
from rlbench_nb.metrics import read_jsonl

from .conftest import REPO, SMALL


def notebook(tmp_path, *cells, name="nb.ipynb"):
    nb = nbformat.v4.new_notebook()
    for src, *tags in cells:
        c = nbformat.v4.new_code_cell(src)
        c.metadata["tags"] = list(tags)
        nb.cells.append(c)
    path = tmp_path / name
    nbformat.write(nb, str(path))
    return path


def run_script(path, *args):
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)


def test_parameters_become_flags_and_interactive_cells_are_dropped(tmp_path):
    nb = notebook(tmp_path,
                  ('steps = 3\nlr = 0.5\nname = "a"\nflag = False\nextra = None\noverrides = []', "parameters"),
                  ('print("steps", steps, lr, name, flag, extra, overrides)',),
                  ('print("DASHBOARD")', "interactive"), ('print("REMOVED")', "remove-cell"),
                  ('text = """line one\n  keep my indent"""\nprint(text)',))
    script = export(nb, tmp_path / "s.py")
    out = run_script(script, "--steps", "7", "--lr", "0.1", "--flag", "true", "--extra", "runs/x", "algo.kl_coef=0.1")
    assert out.returncode == 0, out.stderr
    assert "steps 7 0.1 a True runs/x ['algo.kl_coef=0.1']" in out.stdout
    assert "DASHBOARD" not in out.stdout and "REMOVED" not in out.stdout
    assert "line one\n  keep my indent" in out.stdout  # multi-line strings are not re-indented
    assert "steps 3 0.5 a False None []" in run_script(script).stdout
    help_text = run_script(script, "--help").stdout
    assert "--steps STEPS" in help_text and "default: 3" in help_text
    import importlib.util  # importing the script runs nothing
    spec = importlib.util.spec_from_file_location("s", script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_top_level_await_display_and_dropped_magics(tmp_path):
    nb = notebook(tmp_path, ("n = 2", "parameters"),
                  ("%load_ext rlbench_nb\nimport asyncio\nawait asyncio.sleep(0)\ndisplay({'n': n})",))
    script = export(nb, tmp_path / "s.py")
    assert "asyncio.run(_main_async(argv))" in script.read_text()
    out = run_script(script, "--n", "5")
    assert out.returncode == 0 and "{'n': 5}" in out.stdout


@pytest.mark.parametrize("cells, message", [
    ([("x = 1\n!ls -l",)], "cell 0 ('x = 1'), line 2: IPython syntax '!ls -l' has no plain-Python form"),
    ([("%%time\nx = 1",)], "cell 0 ('%%time'), line 1: IPython syntax '%%time'"),
    ([("def f(:\n  pass",)], "cell 0 ('def f(:'): syntax error on line 1"),
    ([("a = 1", "parameters"), ("b = 2", "parameters")], "two parameters cells: cell 0 ('a = 1') and cell 1 ('b = 2')"),
    ([("import os\na = 1", "parameters")],
     "cell 0 ('import os'): the parameters cell may hold only simple assignments"),
    ([("a = os.getcwd()", "parameters")], "parameter 'a' must be a literal"),
])
def test_bad_notebooks_name_the_cell(tmp_path, cells, message):
    nb = notebook(tmp_path, *cells)
    with pytest.raises(ExportError) as e:
        to_script(nb)
    assert message in str(e.value)


def test_not_a_notebook(tmp_path):
    (tmp_path / "bad.ipynb").write_text("{not json")
    with pytest.raises(ExportError, match="is not a notebook: invalid JSON"):
        to_script(tmp_path / "bad.ipynb")
    (tmp_path / "list.ipynb").write_text("[1, 2]")
    with pytest.raises(ExportError, match="no 'cells' list"):
        to_script(tmp_path / "list.ipynb")
    out = subprocess.run([sys.executable, "-m", "rlbench_nb.cli", "export", str(tmp_path / "bad.ipynb")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("rlbench-nb export: ")


def test_every_shipped_notebook_exports_and_compiles(tmp_path):
    notebooks = sorted((REPO / "notebooks").glob("*.ipynb"))
    assert notebooks
    for nb in notebooks:
        script = export(nb, tmp_path / (nb.stem + ".py"))
        py_compile.compile(str(script), doraise=True)
        nbformat.validate(nbformat.read(str(nb), as_version=4))
        assert all(not c.get("outputs") for c in json.loads(nb.read_text())["cells"]), f"{nb} has outputs"


def test_percent_round_trip_keeps_tags(tmp_path):
    text = to_percent(REPO / "notebooks/01_quickstart.ipynb")
    assert '# %% tags=["parameters"]' in text and '# %% tags=["interactive"]' in text
    assert "# %% [markdown]" in text and "sess = rl.Session(cfg, run_dir=run_dir)" in text


def test_percent_twin_comments_magics_out_and_stays_valid_python(tmp_path):
    nb = notebook(tmp_path, ("%load_ext rlbench_nb\nx = 1",), ("  !ls -l\n%%time\ny = x",))
    text = to_percent(nb)
    assert "# %load_ext rlbench_nb\nx = 1" in text and "#   !ls -l" in text and "# %%time\ny = x" in text
    compile(text, "twin.py", "exec")  # as jupytext writes it: a Python file


def _training_rows(path):
    drop = ("time/", "throughput/", "memory/", "sync/s", "sync/verify_s")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in read_jsonl(path) if "reward/mean" in r]


def test_notebook_and_exported_script_give_the_same_run(tmp_path):
    """nbclient runs the quickstart in a real kernel; its exported script runs with the same parameters."""
    from nbclient import NotebookClient
    overrides = [*SMALL, "run.tensorboard=false"]
    nb = nbformat.read(str(REPO / "notebooks/01_quickstart.ipynb"), as_version=4)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(params + 1, nbformat.v4.new_code_cell(  # what papermill's injected-parameters cell does
        f"steps = 2\nrun_dir = {str(tmp_path / 'nb')!r}\noverrides = {overrides!r}"))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "held-out accuracy" in outputs
    script = export(REPO / "notebooks/01_quickstart.ipynb", tmp_path / "train.py")
    out = subprocess.run([sys.executable, str(script), "--steps", "2", "--run-dir", str(tmp_path / "script"),
                          *overrides], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = _training_rows(tmp_path / "nb" / "metrics.jsonl"), _training_rows(tmp_path / "script" / "metrics.jsonl")
    assert [r["step"] for r in a] == [1, 2]  # one step by hand, then run() until step `steps`
    assert a == b
