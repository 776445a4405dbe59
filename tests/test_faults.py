"""The fault table (docs/faults.md), row by row, with the faults injected for real: the controller
process killed mid-run (CLI and exported script), a save killed half-way, a real allocator failure, a
checkpoint carrying a malicious pickle, a notebook that must not run while it is exported."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rlbench_nb as rl
from rlbench_nb.cluster import WorkerError
from rlbench_nb.metrics import read_jsonl

from .conftest import REPO, SMALL, assert_rollout_holds_policy_weights

TRAIN = [*SMALL, "run.tensorboard=false", "run.save_rollouts_every=0", "run.checkpoint_every=5",
         "cluster.num_threads=1"]


def _rows(run_dir: Path) -> list[dict]:
    """Training rows without wall-clock quantities."""
    drop = ("time/", "throughput/", "memory/", "sync/s")
    return [{k: v for k, v in r.items() if not k.startswith(drop)}
            for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("w"))


def _kill_when(proc: subprocess.Popen, path: Path, timeout: float = 300) -> None:
    """SIGKILL `proc` as soon as `path` exists (it must not have finished by then)."""
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {path} appeared"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    proc.kill()
    proc.wait(timeout=30)


def _run(cmd, **kw):
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _same_as_straight(killed: Path, straight: Path, steps: int) -> None:
    a, b = _rows(straight), _rows(killed)
    assert [r["step"] for r in b] == list(range(1, steps + 1))  # each step once, none lost, none doubled
    assert a == b  # and the numbers a straight run produced
    superseded = killed / "metrics.superseded.jsonl"  # rows written after the last checkpoint are kept aside
    assert not superseded.exists() or all(r["step"] > 10 for r in read_jsonl(superseded))


def test_killed_cli_run_resumes_with_the_metrics_of_a_straight_run(tmp_path):
    cli = [sys.executable, "-m", "rlbench_nb.cli", "train", "configs/arith_grpo.yaml", "--quiet",
           *TRAIN, "run.steps=30", f"run.dir={tmp_path}"]
    proc = _start([*cli, "run.name=killed"], tmp_path / "killed.log")
    _kill_when(proc, tmp_path / "killed" / "checkpoints" / "step_10" / "COMPLETE")
    _run([sys.executable, "-m", "rlbench_nb.cli", "train", "--resume", str(tmp_path / "killed"), "--quiet"])
    _run([*cli, "run.name=straight"])
    _same_as_straight(tmp_path / "killed", tmp_path / "straight", 30)


def test_killed_exported_script_resumes_with_the_metrics_of_a_straight_run(tmp_path):
    from rlbench_nb.export import export
    script = export(REPO / "notebooks/01_quickstart.ipynb", tmp_path / "train.py")
    cmd = [sys.executable, str(script), "--steps", "30", *TRAIN]
    proc = _start([*cmd[:4], "--run-dir", str(tmp_path / "killed"), *cmd[4:]], tmp_path / "killed.log")
    _kill_when(proc, tmp_path / "killed" / "checkpoints" / "step_10" / "COMPLETE")
    _run([sys.executable, str(script), "--steps", "30", "--resume", str(tmp_path / "killed")])
    _run([*cmd[:4], "--run-dir", str(tmp_path / "straight"), *cmd[4:]])
    _same_as_straight(tmp_path / "killed", tmp_path / "straight", 30)


KILL_MID_SAVE = """
import sys, time
from pathlib import Path
import transformers
transformers.logging.disable_progress_bar()
import rlbench_nb as rl
from rlbench_nb.roles.policy import PolicyWorker
run_dir, signal_file = Path(sys.argv[1]), Path(sys.argv[2])
sess = rl.Session(rl.Config.load(None, sys.argv[3:]), run_dir=run_dir)
sess.step()
sess.save("first")
sess.step()

def half_written(self, path):  # the second save: half of the weights file, then the kill
    data = Path(path) / "model.safetensors"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_bytes(b"\\x00" * 4096)
    signal_file.write_text("mid-save")
    time.sleep(120)

PolicyWorker.save = half_written
sess.save("second")
"""


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_as_latest(tmp_path):
    run_dir, flag = tmp_path / "run", tmp_path / "mid-save"
    proc = _start([sys.executable, "-c", KILL_MID_SAVE, str(run_dir), str(flag), *TRAIN, f"run.dir={tmp_path}"],
                  tmp_path / "save.log")
    _kill_when(proc, flag)
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "first"
    assert not (ckpts / "second").exists() and any(p.name.startswith(".second.tmp") for p in ckpts.iterdir())
    with rl.Session.load(run_dir) as sess:  # the previous checkpoint loads, and the session continues from it
        assert sess.step_count == 1
        saved = load_file(str(ckpts / "first" / "policy" / "model.safetensors"))
        assert all(torch.equal(v, saved[k]) for k, v in sess.groups["policy"].call("get_weights")[0].items())
        assert_rollout_holds_policy_weights(sess)
        assert sess.step()["update/skipped"] == 0 and sess.step_count == 2


def test_latest_pointing_at_a_missing_checkpoint_falls_back_to_the_newest_complete_one(tmp_path, small_cfg):
    """The instant between moving an old checkpoint of the same name aside and renaming the new one in."""
    sess = rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run")
    sess.step()
    sess.save("step_1")
    sess.step()
    sess.save("step_2")
    sess.close()
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_2").rename(ckpts / ".step_2.old123")  # killed right here
    sess = rl.Session.load(tmp_path / "run")
    assert sess.step_count == 1
    sess.close()


def test_out_of_memory_names_role_rank_memory_and_the_knobs(small_cfg, monkeypatch):
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    policy = sess.groups["policy"].workers[0]

    def greedy_for_memory(batch, key="old_logprobs_BR"):
        return torch.empty(2**46, dtype=torch.uint8)  # 64 TiB: a real allocator failure, not a raise
    monkeypatch.setattr(policy, "compute_logprobs", greedy_for_memory)
    with pytest.raises(WorkerError) as info:
        sess.prepare(sess.score(sess.rollout()))
    msg = str(info.value)
    assert msg.startswith("policy rank 0 failed in compute_logprobs(): out of memory (the process had ")
    assert " GB resident, " in msg and " GB peak)" in msg
    assert "lower data.batch_size" in msg and "train.micro_batch_size" in msg and "rollout.max_new_tokens" in msg
    monkeypatch.undo()
    assert sess.step()["update/skipped"] == 0  # nothing was left half-done: the session goes on
    sess.close()


class _Payload:
    """Unpickling this runs a shell command: what a poisoned checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["policy/trainer_state.pt", "rollout_state.pt"])
def test_a_checkpoint_with_a_malicious_pickle_is_refused(small_cfg, tmp_path, victim):
    sess = rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run")
    sess.step()
    sess.save("poisoned")
    sess.close()
    marker = tmp_path / "PWNED"
    torch.save({"optimizer": _Payload(marker), "rng": _Payload(marker)},
               tmp_path / "run" / "checkpoints" / "poisoned" / victim)
    with pytest.raises(Exception, match=r"refusing to load .*" + victim.split("/")[-1].replace(".", r"\.")):
        rl.Session.load(tmp_path / "run")
    assert not marker.exists(), "the pickled command ran"


def test_export_never_runs_the_notebook(tmp_path):
    import nbformat

    from rlbench_nb.export import export
    marker = tmp_path / "EXECUTED"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("steps = 1", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(f"open({str(marker)!r}, 'w').write('ran')"),
        nbformat.v4.new_code_cell(f"__import__('os').system('touch {marker}')", metadata={"tags": ["interactive"]}),
    ])
    nbformat.write(nb, tmp_path / "nb.ipynb")
    script = export(tmp_path / "nb.ipynb", tmp_path / "nb.py")
    assert not marker.exists()
    assert f"open({str(marker)!r}, 'w')" in script.read_text()  # the code is copied, as text
    _run([sys.executable, "-m", "rlbench_nb.cli", "export", str(tmp_path / "nb.ipynb"), "-o", str(tmp_path / "x.py")])
    assert not marker.exists()
