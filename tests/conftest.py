"""Shared fixtures: one warm-start cache per test session, and a small fast config."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def warm_start_cache(tmp_path_factory):
    """The built-in warm start runs once per test session (or reuses $RLBENCH_NB_CACHE when set)."""
    if "RLBENCH_NB_CACHE" not in os.environ:
        os.environ["RLBENCH_NB_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    import transformers
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    return Path(os.environ["RLBENCH_NB_CACHE"])


SMALL = ["data.batch_size=8", "rollout.n=4", "run.steps=3", "task.num_test=40", "run.save_rollouts_every=1"]


@pytest.fixture
def small_cfg(tmp_path):
    """A Config factory: the arithmetic task, 8 prompts x 4 samples per step, run dir under tmp_path."""
    from rlbench_nb import Config

    def make(*overrides: str, path: str | None = None):
        return Config.load(path, [f"run.dir={tmp_path / 'runs'}", *SMALL, *overrides])
    return make
