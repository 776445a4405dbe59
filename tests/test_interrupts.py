"""Ctrl-C at any moment loses nothing: SIGINT sent at seeded random moments into a training loop (a real
signal to a real process), under both backends. After every interrupt the optimizer's step count, the
session's, the history and metrics.jsonl agree, and the rollout engine holds the policy's weights; a
checkpoint saved after the interrupts resumes exactly."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import rlbench_nb as rl
from rlbench_nb.guard import deferred_interrupts

from .conftest import REPO, SMALL

CHILD = r'''
import json, sys
from pathlib import Path
import torch
import rlbench_nb as rl
from rlbench_nb.guard import deferred_interrupts
from rlbench_nb.metrics import read_jsonl

run_dir, out, calm = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
# interrupted for at least 40 steps and at least 12 interrupts (a fast CPU runs 40 steps in a few seconds), then
# a checkpoint and 10 quiet steps
FIRST_STEPS, MIN_INTERRUPTS, QUIET = 40, 12, 10
sess = rl.Session(rl.Config.load(None, sys.argv[4:]), run_dir=run_dir)
checks = {"interrupts": 0, "violations": []}

def check():
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    counts = (sess.groups["policy"].call("adam_steps")[0], sess.step_count, len(sess.history), len(rows))
    policy = sess.groups["policy"].call("get_weights")[0]
    same = all(torch.equal(w[k], v) for w in sess.groups["rollout"].call("get_weights") for k, v in policy.items())
    if len(set(counts)) != 1 or not same or sess.state != "ready":
        checks["violations"].append({"counts": counts, "rollout_is_policy": same, "state": sess.state})

go = ("READY", "go")  # the parent interrupts only after this file says so, and it is written inside the try:
# a SIGINT is taken at any bytecode boundary, so one landing on a line outside it would escape the script


def drive():
    (run_dir / go[0]).write_text(go[1])
    while not calm.exists() or sess.step_count < checks["quiet_from"] + QUIET:
        if not calm.exists() and sess.step_count >= FIRST_STEPS and checks["interrupts"] >= MIN_INTERRUPTS:
            checks["quiet_from"] = sess.step_count
            sess.save("quiet")
            calm.write_text("stop interrupting")  # the last steps run straight
            continue
        sess.step()


while True:
    try:
        drive()
        break
    except KeyboardInterrupt:
        checks["interrupts"] += 1
        while True:  # a second interrupt during the check (a tiny window) just means checking again
            try:
                with deferred_interrupts("the check"):
                    check()
                break
            except KeyboardInterrupt:
                checks["interrupts"] += 1
        go = ("ACK", str(checks["interrupts"]))  # the parent may send the next once drive() is back in the try
check()
straight = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
sess.close()
quiet_from = checks["quiet_from"]
again = rl.Session.load(run_dir / "checkpoints" / "quiet", run_dir=run_dir.parent / "resumed")
for _ in range(QUIET):
    again.step()
resumed = [r for r in read_jsonl(run_dir.parent / "resumed" / "metrics.jsonl") if "reward/mean" in r]
again.close()
drop = ("time/", "throughput/", "memory/", "sync/s", "sync/verify_s")
strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]
checks["steps"] = [r["step"] for r in straight]
checks["resume_matches"] = strip(resumed) == strip(straight[quiet_from:])
out.write_text(json.dumps(checks))
'''


def _acknowledged(run_dir) -> int:
    try:
        return int((run_dir / "ACK").read_text())
    except (FileNotFoundError, ValueError):  # none yet, or being written
        return 0


# Cost ~11 s local (Ray: the slow stage): 50 steps with seeded random SIGINTs, then an exact resume against a straight
# run.
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.slow)])  # ray: ~1.5 min
def test_sigint_at_random_moments_leaves_every_count_in_agreement(tmp_path, backend):
    extra = ["cluster.backend=ray", "cluster.num_threads=1"] if backend == "ray" else []
    run_dir, out, calm = tmp_path / "run", tmp_path / "out.json", tmp_path / "calm"
    cmd = [sys.executable, "-c", CHILD, str(run_dir), str(out), str(calm), *SMALL, "run.tensorboard=false",
           "run.save_rollouts_every=0", "task.num_test=8", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp_path / "child.log").open("w"))
    rng = random.Random(1234)
    deadline = time.time() + 300
    while not (run_dir / "READY").exists():
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "child.log").read_text()[-3000:]
        time.sleep(0.05)
    sent = 0
    while proc.poll() is None and not calm.exists() and time.time() < deadline:
        time.sleep(rng.uniform(0.02, 0.25))
        if proc.poll() is None and not calm.exists():
            proc.send_signal(signal.SIGINT)
            sent += 1
            # one at a time, so that no two land in one phase (that abandons it: tests/test_phases.py)
            while proc.poll() is None and _acknowledged(run_dir) < sent and time.time() < deadline:
                time.sleep(0.01)
    assert proc.wait(timeout=max(deadline - time.time(), 10)) == 0, (tmp_path / "child.log").read_text()[-3000:]
    checks = json.loads(out.read_text())
    assert sent >= 12 and checks["interrupts"] >= 12, (sent, checks)
    assert checks["violations"] == [], checks["violations"]
    steps = checks["steps"]
    assert len(steps) >= 50 and steps == list(range(1, len(steps) + 1))  # each step once: none lost, none doubled
    assert checks["resume_matches"]  # the checkpoint saved amid the interrupts resumes exactly


def test_a_controller_killed_before_the_steps_row_leaves_a_record_attach_continues_from(small_cfg, tmp_path,
                                                                                        monkeypatch):
    """controller_state.json is written while the weight push runs, before the step's metrics row: a controller
    killed between the two leaves the trainers, the engine and the record agreeing (what `Session.attach` asks:
    no resync, no push due), one row short."""
    with rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run") as sess:
        sess.step()

        def killed(step, row):
            raise SystemExit("the kernel died here")
        monkeypatch.setattr(sess.metrics, "record_step", killed)
        with pytest.raises(SystemExit):
            sess.step()
        record = sess.rundir.read_state()
        assert record["step"] == 2 and len(sess.history) == 1
        sess.load_controller_state(record)  # what attach reads back, then asks the workers
        assert not sess.progress.trainers_ahead(sess.workers) and not sess.workers.expect_weights(2)


def test_trainers_past_the_last_committed_step_are_found_on_attach(small_cfg, tmp_path, caplog):
    """A controller killed between an update and its commit leaves the trainers a step past its record.
    What `Session.attach` does (read the record back, ask the trainers) puts the session into needs_resync,
    saying why; resync returns every role to the latest checkpoint."""
    with rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run") as sess:
        sess.step()
        committed = sess.controller_state()
        sess.save()
        sess.step()
        sess.load_controller_state(committed)  # the record the kill left: step 1
        assert sess.progress.trainers_ahead(sess.workers)  # what attach asks, then marks the session so
        sess.state = "needs_resync"
        said = "the policy has taken 2 optimizer steps, but this run's last committed step (1) left it at 1"
        assert said in caplog.text
        with pytest.raises(rl.SessionStateError, match="resync"):
            sess.step()
        sess.resync()
        assert sess.state == "ready" and sess.step_count == 1 and sess.groups["policy"].call("adam_steps") == [1]
        assert not sess.progress.trainers_ahead(sess.workers)


def test_an_ignored_sigint_stays_ignored_inside_a_phase_and_a_handled_one_is_held():
    """A process started with SIGINT ignored (`cmd &` without job control) ignores it inside deferred blocks too, and
    leaves it ignored after: catching it only there would honour some Ctrl-Cs and drop the rest. With a handler,
    the block holds it and raises once it is done."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with deferred_interrupts("the check") as held:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert held.count == 0 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt, match="the check completed first"):
            with deferred_interrupts("the check") as held:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                assert held.count == 1
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
