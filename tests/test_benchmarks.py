"""Each benchmark script runs at its smallest setting, so none of them rots."""
import importlib.util
import json
import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.parametrize("script, args", [
    # the two ~50-second ones run in the slow stage (the default run stays well under 30 minutes)
    pytest.param("benchmarks/controller_overhead.py", ["--calls", "2", "--steps", "1", "--backends", "local",
                                                       "ray"], marks=pytest.mark.slow),  # ray: the floors too
    pytest.param("benchmarks/async_overlap.py", ["--steps", "1", "data.batch_size=4", "rollout.n=2", "task.num_test=8",
                                                  "cluster.train_ranks=1"], marks=pytest.mark.slow),
    pytest.param("benchmarks/score_overlap.py", ["--reps", "1", "data.batch_size=4", "rollout.n=2"],
                 marks=pytest.mark.slow),
    pytest.param("benchmarks/multinode_learning.py", [  # the built-in RM of test_reward_model's small task (cached)
        "--steps", "1", "task.num_train=300", "task.num_test=40", "data.batch_size=8", "rollout.n=4",
        "run.eval_every=0"], marks=pytest.mark.slow),
    pytest.param("benchmarks/episodes.py", ["--repeats", "1", "--prompts", "2"],  # the tool task's warm start
                 marks=pytest.mark.slow),
    pytest.param("benchmarks/startup.py", ["--reps", "1"], marks=pytest.mark.slow),  # ~1 min: Ray starts twice
    ("benchmarks/logprob_memory.py", ["--tokens", "64", "--vocab", "1000", "--hidden", "32"]),
    ("benchmarks/rollout_throughput.py",
     ["--sizes", "tiny", "--engines", "plain", "hf", "hf-forward", "--repeats", "1"]),
    ("benchmarks/gpu_smoke.py", ["--tiny", "--steps", "1"]),
    ("benchmarks/soak.py", ["--steps", "3", "--every", "1"]),
    ("benchmarks/reward_isolation.py", ["--batches", "4", "--reps", "1"]),
    ("benchmarks/whatif.py", ["--backends", "local", "--reps", "1", "data.batch_size=8"]),
    ("benchmarks/tinker_overhead.py", ["--models", "tiny", "--reps", "1"]),  # the SDK over HTTP against the same work
    ("benchmarks/packing.py", ["--size", "tiny", "--prompts", "4", "--max-len", "16", "--reps", "1"]),
    ("benchmarks/attention.py", ["--sizes", "tiny", "--steps", "1", "--warmup", "0", "--reps", "1"]),
    ("benchmarks/update_flops.py", ["--sizes", "tiny", "--reps", "1", "--prompts", "2", "--resp-len", "8"]),
    pytest.param("benchmarks/lora.py", ["--sizes", "20m", "--steps", "1", "--warmup", "0", "--reps", "1"],
                 marks=[pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                                             reason="peft not installed")]),
    pytest.param("benchmarks/determinism.py", ["--backends", "local", "--steps", "1", "--warmup", "0", "--reps", "1",
                                                "--settings", "deterministic"], marks=pytest.mark.slow),
    pytest.param("benchmarks/vs_trl.py", ["--backends", "local", "--steps", "1", "--warmup", "0", "--reps", "1"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                          reason="TRL is a benchmark-only dependency: pip install trl")),
])
def test_benchmark_script_runs(script, args, tmp_path):
    out_json = tmp_path / "out.json"
    out = subprocess.run([sys.executable, script, "--json", str(out_json), *args], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data
    assert any(h in out.stdout for h in ("backend", "mode", "method", "engine", "phase", "controller", "framework",
                                          "layout", "attention"))


@pytest.mark.slow
@pytest.mark.real
def test_the_real_model_learning_benchmark_trains_a_seed_and_tabulates_it(real_assets, tmp_path):
    """benchmarks/real_model_learning.py at its smallest: one seed of the README's command for 2 steps, its row
    read back from the run directory, and the base model and the run's checkpoint on 4 held-out questions."""
    out = subprocess.run([sys.executable, "benchmarks/real_model_learning.py", "--seeds", "5", "--held-out", "4",
                          "--root", str(tmp_path), "--json", str(tmp_path / "out.json"), "run.steps=2",
                          "data.test_size=4", "data.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=16",
                          "run.save_rollouts_every=1"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "out.json").read_text())
    (run,) = data["runs"]
    assert run["seed"] == 5 and run["steps"] == 2 and run["eval_n"] == 4 and run["peak_rss_gb"] > 0.3
    assert all(v is not None and 0 <= v <= 1 for v in run["format"] + run["right"])  # logged by the run itself
    assert all(0 < v <= 16 for v in run["length"]) and set(run["sampled_format"]) == {"1", "2"}
    assert data["base"]["n"] == 4 and run["held_out"]["n"] == 4 and data["base"]["length"] > 16  # the config's 96
    assert "#### N format" in out.stdout and "base" in out.stdout
