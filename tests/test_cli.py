"""The `rlbench-nb` command, run as a user runs it (a subprocess)."""
import json
import subprocess
import sys

from .conftest import REPO, SMALL


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "rlbench_nb.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_help_explains_every_field():
    out = cli("train", "--help")
    assert out.returncode == 0
    for text in ("algo.kl_coef", "rollout.temperature", "Dr. GRPO", "--resume"):
        assert text in out.stdout


def test_config_typo_is_one_line_and_exit_2(tmp_path):
    out = cli("train", "configs/arith_grpo.yaml", "algo.kl_cof=0.1", f"run.dir={tmp_path}")
    assert out.returncode == 2
    assert out.stderr.strip() == ("rlbench-nb train: unknown config key 'algo.kl_cof' "
                                  "(did you mean 'algo.kl_coef'?)")
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_an_unknown_command_or_port_is_one_line_and_exit_2(capsys):
    """`rlbench-nb trian` printed the whole help with no word of what was wrong; `serve --port 99999999` served on
    port 57599 (uvicorn wraps it)."""
    import pytest

    from rlbench_nb.cli import main
    from rlbench_nb.errors import UsageError
    from rlbench_nb.serve import TinkerServer
    assert main(["trian", "configs/arith_grpo.yaml"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == ("rlbench-nb: unknown command 'trian' (did you mean 'train'?); the "
                                                 "commands: train, export, report, weights, kernel, data, doctor, "
                                                 "serve, up, down (rlbench-nb --help shows each)")
    with pytest.raises(SystemExit):  # argparse: exit 2, before a session starts
        main(["serve", "configs/arith_grpo.yaml", "--port", "99999999"])
    assert "'99999999' is not a TCP port: 1-65535, or 0 for a free one" in capsys.readouterr().err
    for port in (99999999, -1, "8000"):
        with pytest.raises(UsageError, match=rf"port={port!r}: a TCP port, 1-65535 \(0: a free one\)"):
            TinkerServer(None, port=port)


# Cost ~24 s: two `rlbench-nb train` subprocesses (each imports torch and transformers); the only end-to-end check of
# --resume.
def test_train_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    out = cli("train", "configs/arith_grpo.yaml", *SMALL, "run.steps=4", "--steps", "2", "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert "held-out accuracy" in out.stdout and str(run_dir) in out.stdout
    assert "train:" in out.stderr  # the progress bar
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    out = cli("train", "--resume", str(run_dir), "--quiet")
    assert out.returncode == 0, out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["steps_this_run"] == 2

    # the latest checkpoint's policy as a model folder of its own: whole weights, config, tokenizer
    out = cli("weights", str(run_dir), "-o", str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    saved = load_file(str(run_dir / "checkpoints" / "step_4" / "policy" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert AutoTokenizer.from_pretrained(str(tmp_path / "model"))("12+3=")["input_ids"]
    out = cli("weights", str(run_dir), "-o", str(tmp_path / "model"))
    assert out.returncode == 2 and "exists and is not empty" in out.stderr
