"""run.deterministic: one seed, four ways of running it, the same weights to the bit (issue: "trust the numbers").

(a) the quickstart notebook in a real kernel (nbclient), on a `ray start --head` cluster;
(b) its exported script with plain `python` (an embedded Ray);
(c) the exported script under `ray job submit` on that head;
(d) the notebook again with detached actors, its kernel killed in step 26 right after the rollout (the engine's
    RNG moved on, nothing committed), continued to the end from another process with `Session.attach`.
Same config and rank layout (2 FSDP2 policy ranks over gloo, 1 rollout rank), 50 steps, on the CPU.
"""
import hashlib
import os
import subprocess
import sys
import textwrap
import time

import nbformat
import pytest

from rlbench_nb.export import export
from rlbench_nb.metrics import read_jsonl

from .conftest import REPO
from .ray_heads import RayHead, free_port

pytest.importorskip("ray")
RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
STEPS = 50
CONFIG = ["data.batch_size=8", "rollout.n=4", "task.num_test=16", "run.tensorboard=false", "run.save_rollouts_every=0",
          "run.checkpoint_every=10", "run.deterministic=true", "cluster.backend=ray", "cluster.train_ranks=2"]
# SIGKILLs the kernel in step 26, after its rollout came back: nothing of the step is committed
KILL_IN_STEP_26 = textwrap.dedent("""
    import os, signal
    _collect = sess._collect_rollout
    def _killed_after_the_rollout(started):
        out = _collect(started)
        if sess.step_count == 25:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    sess._collect_rollout = _killed_after_the_rollout
""")
ATTACH_AND_FINISH = textwrap.dedent("""
    import sys
    import rlbench_nb as rl
    sess = rl.Session.attach(sys.argv[1], address=sys.argv[2])
    assert sess.step_count == 25, sess.step_count
    print("attached at step", sess.step_count, "state", sess.state)
    sess.run(steps=int(sys.argv[3]) - sess.step_count, progress=False)
    sess.close()
""")


@pytest.fixture
def ray_head_with_jobs():
    """A head with its dashboard (the job API) on loopback; token auth, as documented. Yields (gcs, dashboard).
    Stopped alone (tests/ray_heads.py), not with `ray stop`, which stops every cluster on the machine."""
    dash = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    with RayHead(dashboard_port=dash) as head:
        deadline = time.time() + 120  # the job API comes up a little after the head
        while subprocess.run([RAY_CLI, "job", "list", "--address", f"http://127.0.0.1:{dash}"], capture_output=True,
                             timeout=60, env=env).returncode != 0 and time.time() < deadline:
            time.sleep(2)
        yield head.address, f"http://127.0.0.1:{dash}"


def _run_notebook(run_dir, overrides, extra_cell: str | None = None):
    """The quickstart with papermill-style parameters; `extra_cell` goes right after the session is made."""
    from nbclient import NotebookClient
    nb = nbformat.read(str(REPO / "notebooks/01_quickstart.ipynb"), as_version=4)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(params + 1, nbformat.v4.new_code_cell(
        f"steps = {STEPS}\nrun_dir = {str(run_dir)!r}\noverrides = {overrides!r}"))
    if extra_cell:
        made = next(i for i, c in enumerate(nb.cells) if "sess = rl.Session(" in c.source)
        nb.cells.insert(made + 1, nbformat.v4.new_code_cell(extra_cell))
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()


def _final_weights(run_dir) -> str:
    from rlbench_nb.roles.shards import whole_tensors  # the two ranks' shards, joined
    w = whole_tensors(run_dir / "checkpoints" / f"step_{STEPS}" / "policy")
    return hashlib.sha256(b"".join(k.encode() + w[k].numpy().tobytes() for k in sorted(w))).hexdigest()


def _training_rows(run_dir) -> list[dict]:
    drop = ("time/", "throughput/", "memory/", "sync/")
    return [{k: v for k, v in r.items() if not k.startswith(drop)}
            for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


@pytest.mark.slow
def test_notebook_script_ray_job_and_a_killed_kernel_give_bit_identical_weights(ray_head_with_jobs, tmp_path):
    from nbclient.exceptions import DeadKernelError
    gcs, dashboard = ray_head_with_jobs
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    runs = {k: tmp_path / k for k in ("notebook", "script", "job", "killed")}

    _run_notebook(runs["notebook"], [*CONFIG, f"cluster.address={gcs}"])

    (tmp_path / "job_files").mkdir()  # the job's working directory: the script alone
    script = export(REPO / "notebooks/01_quickstart.ipynb", tmp_path / "job_files" / "train.py")
    out = subprocess.run([sys.executable, str(script), "--steps", str(STEPS), "--run-dir", str(runs["script"]),
                          *CONFIG], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]

    out = subprocess.run(
        [RAY_CLI, "job", "submit", "--address", dashboard, "--working-dir", str(script.parent), "--",
         sys.executable, "train.py", "--steps", str(STEPS), "--config", str(REPO / "configs/arith_grpo.yaml"),
         "--run-dir", str(runs["job"]), *CONFIG],
        capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0 and "succeeded" in out.stdout, (out.stdout + out.stderr)[-3000:]

    with pytest.raises(DeadKernelError):
        _run_notebook(runs["killed"], [*CONFIG, f"cluster.address={gcs}", "cluster.detached=true"], KILL_IN_STEP_26)
    assert len(_training_rows(runs["killed"])) == 25  # killed in step 26, before its commit
    out = subprocess.run([sys.executable, "-c", ATTACH_AND_FINISH, runs["killed"].name, gcs, str(STEPS)],
                         cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0 and "state ready" in out.stdout, (out.stdout + out.stderr)[-3000:]

    weights = {k: _final_weights(d) for k, d in runs.items()}
    assert len(set(weights.values())) == 1, weights
    rows = {k: _training_rows(d) for k, d in runs.items()}
    assert [r["step"] for r in rows["notebook"]] == list(range(1, STEPS + 1))
    assert rows["script"] == rows["notebook"] and rows["job"] == rows["notebook"] and rows["killed"] == rows["notebook"]
