"""The Tinker client side of the tests: the real `tinker` SDK and tinker-cookbook recipes, unmodified, in an
environment of their own (tinker-cookbook 0.5.8 pins transformers<=5.5.4; this project pins 5.19), talking HTTP to
`rlbench-nb serve`. `client_python()` builds that environment once (REPO/.venv-tinker-client, ~1 minute, from
tests/tinker-client-constraints.txt) and reuses it; `run_recipe` runs a recipe as published, with its data from
local rows (`datasets.load_dataset` patched in tests/tinker_recipe.py, never the recipe) and the renderer named."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

CLIENT_ENV = REPO / ".venv-tinker-client"
CONSTRAINTS = REPO / "tests" / "tinker-client-constraints.txt"
PACKAGES = ["torch==2.13.0", "tinker==0.38.0", "tinker-cookbook==0.5.8", "pylatexenc==2.11"]


def client_python() -> Path:
    python = CLIENT_ENV / "bin" / "python"
    ready = CLIENT_ENV / ".ready"
    if ready.exists() and ready.read_text() == CONSTRAINTS.read_text():
        return python
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter under this venv: a venv of its own
    subprocess.run([base, "-m", "venv", "--clear", str(CLIENT_ENV)], check=True)
    # --no-compile: no .pyc for the thousands of modules the recipes never import (96 -> 61 s on the 2-core EPYC,
    # half the CPU); the ones they do import compile on first use, once
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile", "-c", str(CONSTRAINTS)]
    subprocess.run(pip + PACKAGES[:1], check=True)  # torch first: the CPU build from this machine's index
    subprocess.run(pip + PACKAGES[1:], check=True)
    ready.write_text(CONSTRAINTS.read_text())
    return python


def run_recipe(recipe: str, env: dict[str, str], rows: list[dict], renderer: str, log_path: Path,
               overrides: list[str], timeout: float = 900) -> list[dict]:
    """Run tinker_cookbook.recipes.<recipe> against the server in `env` (TINKER_BASE_URL, TINKER_API_KEY); returns
    the rows of its metrics.jsonl."""
    data = log_path.parent / f"{recipe}_rows.json"
    data.write_text(json.dumps(rows))
    cmd = [str(client_python()), str(REPO / "tests" / "tinker_recipe.py"), recipe, *overrides,
           f"base_url={env['TINKER_BASE_URL']}", f"log_path={log_path}"]
    child_env = {**os.environ, **env, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
                 "RECIPE_ROWS": str(data), "RECIPE_RENDERER": renderer}
    child_env.pop("PYTHONPATH", None)
    out = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{recipe} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
