"""The product's promise on the built-in task: RL raises held-out accuracy over the warm start, with
either rollout engine."""
import importlib.util

import pytest

import rlbench_nb as rl

from .conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("engine", [
    "hf",
    pytest.param("vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")),
])
def test_grpo_raises_held_out_accuracy(tmp_path, engine):
    cfg = rl.Config.load(REPO / "configs/arith_grpo.yaml", [f"run.dir={tmp_path}", "run.tensorboard=false",
                                                             f"rollout.engine={engine}"])
    sess = rl.Session(cfg)
    summary = sess.run(progress=False)
    sess.close()
    # measured on 2 CPU cores: hf 0.345 -> 0.555 in ~60 s, vllm 0.345 -> see README; 0.15 is the bar
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.15, summary
