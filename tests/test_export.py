"""Notebook -> script export: tags, flags, magics, await, round trip, bad input, and run parity."""
import importlib.util
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
    assert "asyncio.run(_main_async(_argv))" in script.read_text()
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
    ([("steps = 3\nhelp = 'x'", "parameters")], "cell 0 ('steps = 3'), line 2: a parameter named 'help'"),
    ([("x = 1",), ("name = input()\nprint(name)",)],
     "cell 1 ('name = input()'), line 1: input() waits for someone to type"),
    ([("if True:\n    from os.path import *",)], "cell 0 ('if True:'), line 2: `from os.path import *` inside a block"),
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


# Cost ~35 s: the quickstart in a kernel, then its script and its marimo twin; the only parity check of the three.
@pytest.mark.integration  # a real kernel: the second stage (pyproject.toml's markers)
def test_notebook_and_exported_script_give_the_same_run(tmp_path):
    """nbclient runs the quickstart in a real kernel; its exported script and its marimo twin run with the same
    parameters: the same rows, three ways."""
    from nbclient import NotebookClient
    overrides = [*SMALL, "run.tensorboard=false"]
    nb = nbformat.read(str(REPO / "notebooks/01_quickstart.ipynb"), as_version=4)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(params + 1, nbformat.v4.new_code_cell(  # what papermill's injected-parameters cell does
        f"steps = 2\nrun_dir = {str(tmp_path / 'nb')!r}\noverrides = {overrides!r}"))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "held-out accuracy" in outputs
    elsewhere = tmp_path / "elsewhere"  # not the repository: the script carries the config it names
    elsewhere.mkdir()
    script = export(REPO / "notebooks/01_quickstart.ipynb", elsewhere / "train.py")
    out = subprocess.run([sys.executable, str(script), "--steps", "2", "--run-dir", str(tmp_path / "script"),
                          *overrides], cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = _training_rows(tmp_path / "nb" / "metrics.jsonl"), _training_rows(tmp_path / "script" / "metrics.jsonl")
    assert [r["step"] for r in a] == [1, 2]  # one step by hand, then run() until step `steps`
    assert a == b
    if importlib.util.find_spec("marimo"):  # the marimo twin runs as a script too (in the test extra)
        twin = export(REPO / "notebooks/01_quickstart.ipynb", elsewhere / "twin.py", "marimo")
        out = subprocess.run([sys.executable, str(twin), "--steps", "2", "--run-dir", str(tmp_path / "marimo"),
                              *overrides], cwd=elsewhere, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert _training_rows(tmp_path / "marimo" / "metrics.jsonl") == a


def test_what_a_notebook_means_the_script_means_too(tmp_path):
    """A parameter assigned twice keeps its last value; one named `args` works; a star import moves to the
    module; a name a cell's function declares global is the same variable the other cells use."""
    nb = notebook(tmp_path, ("steps = 1\nargs = 'a'\nsteps = 5", "parameters"),
                  ("from math import *\ncounter = 0",),
                  ("def bump():\n    global counter\n    counter += 1\n\nbump()\nglobal counter\nbump()",),
                  ("print(steps, args, counter, floor(pi))",))
    script = export(nb, tmp_path / "nb.py")
    out = run_script(script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "a", "2", "3"]
    assert run_script(script, "--args", "b", "--steps", "7").stdout.split() == ["7", "b", "2", "3"]


def test_an_old_format_notebook_is_upgraded_not_refused(tmp_path):
    """nbformat 3 (worksheets, `input`): what older Jupyter wrote, and tools still emit."""
    v3 = {"nbformat": 3, "nbformat_minor": 0, "metadata": {"name": "old"},
          "worksheets": [{"cells": [{"cell_type": "code", "input": ["x = 40\n", "print(x + 2)"], "language": "python",
                                     "outputs": [], "metadata": {}, "prompt_number": 1}], "metadata": {}}]}
    (tmp_path / "old.ipynb").write_text(json.dumps(v3))
    out = run_script(export(tmp_path / "old.ipynb", tmp_path / "old.py"))
    assert out.returncode == 0 and out.stdout.strip() == "42", out.stderr


def test_exports_never_overwrite_a_notebook_or_a_stranger(tmp_path):
    nb = notebook(tmp_path, ("x = 1",))
    with pytest.raises(ExportError, match="would overwrite a notebook"):
        export(nb, nb)
    with pytest.raises(ExportError, match="would overwrite a notebook"):
        export(nb, tmp_path / "other.ipynb")
    mine = tmp_path / "nb.py"
    mine.write_text("my own work\n")
    with pytest.raises(ExportError, match="exists and is not an export of nb.ipynb: choose another -o, or --force"):
        export(nb, mine)
    assert mine.read_text() == "my own work\n"  # untouched
    export(nb, mine, force=True)
    export(nb, mine)  # an earlier export of the same notebook is replaced without asking
    out = subprocess.run([sys.executable, "-m", "rlbench_nb.cli", "export", str(nb)], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0 and (tmp_path / "nb.py").read_text().startswith('"""Exported from')


def test_a_config_the_notebook_names_travels_with_the_script(tmp_path):
    """The YAML is embedded with its relative data path made absolute (from the notebook's folder, as the
    notebook finds it); a flag naming another file still wins; a plain file parameter becomes absolute."""
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)  # found from notebooks/ one folder up, as Config.load does
    (project / "notebooks" / "data").mkdir(parents=True)  # opened from the kernel's folder: the notebook's
    (project / "notebooks" / "data" / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    (project / "configs" / "exp.yaml").write_text("data:\n  train_path: data/train.jsonl\nrun:\n  steps: 3\n")
    nb = notebook(project / "notebooks", ("config = 'configs/exp.yaml'\nrows = 'data/train.jsonl'", "parameters"),
                  ("import rlbench_nb as rl\ncfg = rl.Config.load(config)\nprint(cfg.data.train_path, cfg.run.steps)\n"
                   "print(open(rows).read().strip())",))
    away = tmp_path / "away"
    away.mkdir()
    script = export(nb, away / "exp.py")
    out = subprocess.run([sys.executable, str(script)], cwd=away, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == f"{(project / 'notebooks' / 'data' / 'train.jsonl').resolve()} 3"
    assert lines[1] == '{"prompt": "1+1="}'
    (away / "mine.yaml").write_text("run:\n  steps: 9\n")
    out = subprocess.run([sys.executable, str(script), "--config", "mine.yaml"], cwd=away, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines()[0].endswith(" 9"), out.stderr[-2000:]
