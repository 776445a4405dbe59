"""The package's shape holds: no import cycles between modules, each layer imports only the layers below
it (DESIGN.md), and the linter (ruff, configured in pyproject.toml) finds nothing."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

PACKAGE = REPO / "rlbench_nb"

# layer -> the package's layers it must not import at module level (a function may import lazily, as
# Session.dashboard() does the widgets)
FORBIDDEN = {
    "algos": ("cluster", "data", "roles", "metrics", "session", "runner", "widgets", "ipython", "checkpoint"),
    "rewards": ("cluster", "data", "roles", "metrics", "session", "runner", "widgets", "ipython", "checkpoint"),
    "envs": ("cluster", "data", "roles", "metrics", "session", "runner", "widgets", "ipython", "checkpoint"),
    "data": ("cluster", "roles", "session", "runner", "widgets", "ipython", "checkpoint"),
    "metrics": ("cluster", "roles", "session", "runner", "widgets", "ipython"),
    "roles": ("cluster", "session", "runner", "widgets", "ipython"),
    "cluster": ("roles", "session", "runner", "widgets", "ipython"),
    "session": ("widgets", "ipython"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """Modules of this package imported at module level (not inside functions or `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("rlbench_nb"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rlbench_nb"))
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _top_level_imports(p) for p in PACKAGE.rglob("*.py")}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in graph.get(m, ()):
            # a package's __init__ importing its own submodules is how packages re-export: not a cycle
            if dep.startswith(m + "."):
                continue
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_each_layer_imports_only_the_layers_below_it():
    bad = []
    for module, deps in _graph().items():
        layer = module.split(".")[1] if "." in module else ""
        for dep in deps:
            dep_layer = dep.split(".")[1] if "." in dep else ""
            if dep_layer in FORBIDDEN.get(layer, ()):
                bad.append(f"{module} imports {dep}")
    assert not bad, bad


@pytest.mark.skipif(shutil.which("ruff") is None and sys.modules.get("ruff") is None, reason="ruff not installed")
def test_the_linter_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "rlbench_nb", "tests", "benchmarks", "docs"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:]
