"""The product's promise on the built-in task: RL raises held-out accuracy over the warm start, with
either rollout engine."""
import importlib.util

import pytest

import rlbench_nb as rl

from .conftest import REPO


@pytest.mark.slow
def test_the_main_job_raises_held_out_accuracy_past_the_bar(tmp_path):
    """configs/arith_grpo.yaml as `rlbench-nb train` runs it (seed 0). README: +0.29 to +0.37 over three seeds
    and both x86 kernel sets, ending at 0.73-0.81; the bar is +0.25 and 0.60."""
    cfg = rl.Config.load(REPO / "configs/arith_grpo.yaml", [f"run.dir={tmp_path}", "run.tensorboard=false"])
    with rl.Session(cfg) as sess:
        summary = sess.run(progress=False)
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.25, summary
    assert summary["accuracy_after"] >= 0.60, summary


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed")
def test_lora_grpo_raises_held_out_accuracy(tmp_path):
    """configs/arith_grpo_lora.yaml (r=16 on every linear layer, lr 1e-3), seed 0. Measured on a 2-core AMD EPYC
    (AVX-512): 0.372 -> 0.630 (+0.258); lr 2e-3 gave +0.242 on a Xeon but +0.12 on the EPYC. The bar is +0.15."""
    cfg = rl.Config.load(REPO / "configs/arith_grpo_lora.yaml", [f"run.dir={tmp_path}", "run.tensorboard=false"])
    with rl.Session(cfg) as sess:
        summary = sess.run(progress=False)
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.15, summary


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_grpo_with_the_vllm_engine_learns(tmp_path):
    """The same run with vLLM generating, shortened to 150 steps (vLLM's per-request overhead makes a step
    ~3x the HF engine's on this tiny model). Its train reward is the steadier signal that early (256
    samples a step, averaged over 10 steps each end): the HF engine goes ~0.36 -> ~0.55 by then."""
    cfg = rl.Config.load(REPO / "configs/arith_grpo.yaml", [f"run.dir={tmp_path}", "run.tensorboard=false",
                                                             "rollout.engine=vllm", "run.steps=150",
                                                             "task.num_test=100"])
    with rl.Session(cfg) as sess:
        summary = sess.run(progress=False)
    assert summary["reward_last"] - summary["reward_first"] >= 0.10, summary


@pytest.mark.slow
def test_the_tool_task_learns_to_call_the_calculator(tmp_path):
    """configs/arith_tool_grpo.yaml (4-digit sums, a calculator tool, 60 GRPO steps), seed 0. Measured on this
    2-core Xeon, seeds 0/1/2: held-out 0.464 -> 0.938 / 0.938 / 0.930, greedy episodes calling the tool
    0.55 -> 1.0, ~20 s of training after a ~30 s warm start. The issue's bar is +0.15 and a rising tool share."""
    cfg = rl.Config.load(REPO / "configs/arith_tool_grpo.yaml", [f"run.dir={tmp_path}", "run.tensorboard=false"])
    with rl.Session(cfg) as sess:
        summary = sess.run(progress=False)
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.15, summary
    evals = [r for r in rl.metrics.read_jsonl(sess.run_dir / "metrics.jsonl") if "eval/tool_use" in r]
    assert evals[-1]["eval/tool_use"] >= evals[0]["eval/tool_use"] + 0.15, evals
    train = [r for r in rl.metrics.read_jsonl(sess.run_dir / "metrics.jsonl") if "env/tool_use" in r]
    assert sum(r["env/tool_use"] for r in train[-5:]) / 5 >= sum(r["env/tool_use"] for r in train[:5]) / 5 + 0.15
