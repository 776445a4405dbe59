"""What a notebook user relies on when re-running cells: phases leave their input alone, re-running one
moves no hidden state, the session refuses what would interleave, and errors say what they are."""
import json
import pickle
import subprocess
import sys
import threading

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.cluster.errors import WorkerDiedError

from .conftest import REPO


def _digest(batch: rl.Batch) -> tuple:
    return ({k: v.clone() for k, v in batch.tensors.items()}, {k: list(v) for k, v in batch.meta.items()},
            {k: dict(v) if isinstance(v, dict) else v for k, v in batch.info.items()})


def _assert_unchanged(batch: rl.Batch, digest: tuple) -> None:
    tensors, meta, info = digest
    assert batch.tensors.keys() == tensors.keys() and all(torch.equal(batch.tensors[k], v) for k, v in tensors.items())
    assert batch.meta == meta and batch.info == info


def test_phases_return_a_new_batch_and_leave_their_input_as_it_was(small_cfg):
    with rl.Session(small_cfg("run.tensorboard=false", "algo.kl_coef=0.05")) as sess:
        rolled = sess.rollout()
        before = _digest(rolled)
        scored = sess.score(rolled)
        _assert_unchanged(rolled, before)
        assert "scores_B" in scored and "scores_B" not in rolled

        @sess.reward
        def zero(prompt, response, **_):
            return 0.0

        rescored = sess.score(scored)  # "old vs new" in a notebook: two different objects with two answers
        assert scored["scores_B"].sum() > 0 and rescored["scores_B"].sum() == 0
        before = _digest(rescored)
        prepared = sess.prepare(rescored)
        _assert_unchanged(rescored, before)
        assert "advantages_BR" in prepared and "advantages_BR" not in rescored
        before = _digest(prepared)
        sess.update(prepared)
        _assert_unchanged(prepared, before)
        assert "advantages_BR" not in sess.score(prepared)  # re-scored: stale advantages are dropped


def test_preparing_twice_moves_the_adaptive_kl_controller_once_per_step(small_cfg):
    cfg = small_cfg("run.tensorboard=false", "algo.kl_coef=0.1", "algo.kl_ctrl=adaptive", "algo.target_kl=0.001",
                    "algo.kl_horizon=10", "train.lr=1e-2")
    with rl.Session(cfg) as sess:
        sess.step()  # the policy moves away from the reference: KL > 0
        batch = sess.score(sess.rollout())
        value = sess.progress.kl.value
        first, second = sess.prepare(batch), sess.prepare(batch)
        assert sess.progress.kl.value == value  # re-running a prepare cell moves nothing
        assert torch.equal(first["advantages_BR"], second["advantages_BR"])
        sess.update(first)
        # Ziegler et al.: value *= 1 + clip(kl / target - 1, +-0.2) * n / horizon, once
        assert sess.progress.kl.value == pytest.approx(value * (1 + 0.2 * len(batch) / 10))


def test_the_critics_values_come_with_the_score_and_are_reused_only_under_the_same_weights(small_cfg):
    """score starts the critic's value pass beside the rewards (under Ray on its own workers, at the same
    time); prepare reuses those values while the weights are unchanged, and computes them anew after an update."""
    with rl.Session(small_cfg("run.tensorboard=false", "algo.advantage=gae")) as sess:
        critic = sess.groups["critic"]

        def passes():
            return sum(r.method == "compute_values" for r in critic.records)
        scored = sess.score(sess.rollout())
        assert "values_BR" in scored and passes() == 1
        prepared = sess.prepare(scored)
        assert passes() == 1 and torch.equal(prepared["values_BR"], scored["values_BR"])
        assert torch.equal(sess.score(prepared)["values_BR"], scored["values_BR"]) and passes() == 1  # re-scored
        sess.update(prepared)
        again = sess.prepare(scored)  # the critic moved: its old values are not this critic's
        assert passes() == 2 and not torch.equal(again["values_BR"], scored["values_BR"])
        fresh = critic.call_split("compute_values", scored)["values_BR"]
        assert torch.equal(again["values_BR"], fresh)
        # a branch moves the critic and comes back: values scored inside it are not the main line's
        with sess.branch("moved") as b:
            b.run(1, progress=False)
            inside = sess.score(sess.rollout())
        n = passes()
        back = sess.prepare(inside)
        assert passes() == n + 1
        assert torch.equal(back["values_BR"], critic.call_split("compute_values", inside)["values_BR"])
        # nor are another session's, whatever its history
        with rl.Session(small_cfg("run.tensorboard=false", "algo.advantage=gae", "run.name=other")) as other:
            other_scored = other.score(other.rollout())
        n = passes()
        sess.prepare(other_scored)
        assert passes() == n + 1


def test_batch_table_shows_reward_length_and_advantage(small_cfg):
    with rl.Session(small_cfg("run.tensorboard=false")) as sess:
        batch = sess.prepare(sess.score(sess.rollout()))
    row = batch.rows()[0]
    assert list(row) == ["prompt", "response", "answer", "reward", "advantage", "length", "reward_error"]
    assert row["reward"] == batch["scores_B"][0].item() and row["length"] == batch["response_len_B"][0].item()
    header = batch._repr_html_().split("</tr>")[0]
    assert all(f"<th>{c}</th>" in header for c in ("reward", "advantage", "length"))


def test_a_non_finite_critic_loss_is_counted_and_stops_the_run_like_the_policys(small_cfg):
    cfg = small_cfg("run.tensorboard=false", "algo.advantage=gae", "train.max_skipped_steps=2")
    with rl.Session(cfg) as sess:
        critic = sess.groups["critic"].workers[0]
        before = {k: v.clone() for k, v in critic.model.state_dict().items()}
        batch = sess.prepare(sess.score(sess.rollout()))
        row = sess.update(batch.replace(returns_BR=torch.full_like(batch["returns_BR"], float("nan"))))
        assert row["update/critic_skipped"] == 1 and row["update/critic_skipped_nonfinite_loss"] == 1
        assert row["update/skipped"] == 0  # the policy's own step went ahead
        assert all(torch.equal(v, critic.model.state_dict()[k]) for k, v in before.items())
        batch = sess.prepare(sess.score(sess.rollout()))
        with pytest.raises(rl.RLBenchError, match="the critic update was skipped 2 steps in a row"):
            sess.update(batch.replace(returns_BR=torch.full_like(batch["returns_BR"], float("nan"))))


def test_a_closed_session_and_a_background_run_refuse_phases(small_cfg):
    with rl.Session(small_cfg("run.tensorboard=false")) as sess:
        owned, release = threading.Event(), threading.Event()

        def background():  # what a background run's thread holds while it steps
            with sess.guard.owned_by_this_thread():
                owned.set()
                release.wait(30)

        t = threading.Thread(target=background)
        t.start()
        owned.wait(30)
        try:
            for phase in (sess.rollout, sess.step, sess.save, sess.evaluate):
                with pytest.raises(rl.SessionStateError, match="while a background run is stepping"):
                    phase()
        finally:
            release.set()
            t.join()
        sess.rollout()  # the run ended: the cell works again
    assert sess.state == "closed"
    with pytest.raises(rl.SessionStateError, match="the session is closed"):
        sess.rollout()
    with pytest.raises(rl.SessionStateError, match="the session is closed"):
        sess.save("after_close")
    assert not (sess.run_dir / "checkpoints").exists()


def test_on_step_subscribes_and_unsubscribes(small_cfg):
    with rl.Session(small_cfg("run.tensorboard=false")) as sess:
        seen = []
        unsubscribe = sess.on_step(seen.append)
        sess.step()
        unsubscribe()
        sess.step()
        assert len(seen) == 1 and seen[0]["reward/mean"] == sess.history[0]["reward/mean"]
        with pytest.raises(TypeError):
            sess.run(1, False)  # flags are keyword-only


def test_errors_share_one_base_and_keep_their_type_across_processes():
    for cls in (rl.ConfigError, rl.CheckpointError, rl.DatasetError, rl.WorkerError, rl.ClusterError,
                rl.SessionStateError, rl.BackgroundRunError):
        assert issubclass(cls, rl.RLBenchError)
    assert issubclass(rl.ConfigError, ValueError) and issubclass(rl.WorkerError, RuntimeError)
    died = WorkerDiedError("policy", 1, "update", "the worker process died", "x.py:3: f()", "tb")
    back = pickle.loads(pickle.dumps(died))
    assert type(back) is WorkerDiedError and (back.role, back.rank, back.frame) == ("policy", 1, "x.py:3: f()")


def test_the_cli_explains_its_own_errors_in_one_line_and_keeps_a_bugs_traceback(tmp_path):
    typo = subprocess.run([sys.executable, "-m", "rlbench_nb.cli", "train", "configs/arith_grpo.yaml",
                           "train.lrr=1"], capture_output=True, text=True, cwd=REPO)
    assert typo.returncode == 2 and typo.stderr.strip().count("\n") == 0 and "did you mean 'train.lr'" in typo.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("1 / 0\n\ndef reward(prompt, response, **row):\n    return 1.0\n")
    bug = subprocess.run([sys.executable, "-m", "rlbench_nb.cli", "train", "configs/arith_grpo.yaml",
                          f"reward.fn={broken}:reward", f"run.dir={tmp_path}"], capture_output=True, text=True,
                         cwd=REPO)
    assert bug.returncode == 1 and "Traceback (most recent call last)" in bug.stderr
    assert "ZeroDivisionError" in bug.stderr


def test_a_second_ctrl_c_abandons_the_update_and_the_session_asks_for_resync(small_cfg, tmp_path, monkeypatch):
    """One Ctrl-C waits for the update; a second abandons it half-way: the optimizer may have moved while
    the step was not recorded, so the session refuses phases until `resync()` brings every role back to
    the latest checkpoint, where all counts agree again."""
    import os
    import signal

    from rlbench_nb.guard import Abandoned
    sess = rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run")
    sess.step()
    sess.save("one")
    policy = sess.groups["policy"].workers[0]
    real_update = policy.update

    def interrupted_twice(*a, **k):
        out = real_update(*a, **k)  # the optimizer has stepped: the controller has not recorded it
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return out
    monkeypatch.setattr(policy, "update", interrupted_twice)
    with pytest.raises(Abandoned, match="update was abandoned half-way"):
        sess.step()
    assert sess.state == "needs_resync" and policy.adam_steps() == 2 and sess.step_count == 1
    with pytest.raises(rl.SessionStateError, match=r"call sess.resync\(\)"):
        sess.rollout()
    monkeypatch.undo()
    sess.resync()
    assert sess.state == "ready" and policy.adam_steps() == sess.step_count == len(sess.history) == 1
    sess.step()
    assert policy.adam_steps() == sess.step_count == 2
    sess.close()


def test_calls_started_together_are_each_collected_once_and_the_first_failure_wins():
    """cluster.base.finish_all, with stand-in groups: after a failure the other groups' calls are still waited for
    (no worker left busy), but not a failed group's queued calls, and nothing after an interrupt."""
    from rlbench_nb.cluster.base import finish_all as _finish_all

    class Group:
        def __init__(self, fails=None):
            self.fails, self.collected = fails, []

        def collect(self, pending):
            self.collected.append(pending)
            if self.fails:
                raise self.fails
            return [pending]

    ok, bad = Group(), Group(RuntimeError("critic hung"))
    assert _finish_all(lambda: "rewards", (ok, "values"), None) == ("rewards", [["values"], None])
    with pytest.raises(RuntimeError, match="critic hung"):
        _finish_all(lambda: None, (bad, "first"), (bad, "queued behind it"), (ok, "other"))
    assert bad.collected == ["first"] and ok.collected == ["values", "other"]

    def rewards_fail():
        raise ValueError("reward failed")
    with pytest.raises(ValueError, match="reward failed"):
        _finish_all(rewards_fail, (ok, "still collected"))
    assert ok.collected[-1] == "still collected"

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _finish_all(interrupted, (ok, "not waited for"))
    assert ok.collected[-1] == "still collected"


@pytest.mark.parametrize("where", ["before its rollout", "after its rollout"])
def test_a_step_interrupted_then_run_again_draws_what_a_straight_run_draws(small_cfg, monkeypatch, where):
    """Ctrl-C in a step rewinds the data position and, if this step's rollout drew, the sampling RNG: the step
    run again is the straight run's. Interrupted before its own draw, the engine must not go back to the
    previous step's draw (it did: a resumed run then repeated that step's samples; seen in CI as a resumed
    run's step 11 differing from a straight run's)."""
    straight = rl.Session(small_cfg("run.tensorboard=false"))
    want = [straight.step() for _ in range(2)][1]
    straight.close()
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    sess.step()
    target = (sess.prompts, "encode") if where == "before its rollout" else (sess, "score")
    original = getattr(*target)

    def interrupted(*a, **k):
        monkeypatch.setattr(*target, original)  # once
        raise KeyboardInterrupt
    monkeypatch.setattr(*target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        sess.step()
    got = sess.step()
    assert sess.step_count == 2
    keys = ("reward/mean", "response_len/mean", "loss/policy", "entropy", "actor/grad_norm")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    sess.close()


def test_a_combined_reward_reports_each_part_in_steps_evaluations_files_and_the_report(small_cfg):
    """combine() keeps each part's own score: the metrics average them (reward/part/*, eval/part/*), the
    rollout files and the inspector carry them per sample, the summary and the report say held-out before ->
    after; a plain reward afterwards leaves no stale parts behind."""
    from rlbench_nb.report import report_from_run_dir
    from rlbench_nb.rewards import combine

    def right(prompt, response, answer, **_):
        return float(response.strip() == str(answer))

    def short(prompt, response, **_):
        return float(len(response.strip()) <= 2)

    with rl.Session(small_cfg("run.tensorboard=false", "run.steps=2")) as sess:
        sess.reward(combine((right, 1.0), (short, 0.5)))
        summary = sess.run(progress=False)
        for row in sess.history:
            assert row["reward/mean"] == pytest.approx(row["reward/part/right"] + 0.5 * row["reward/part/short"],
                                                       abs=1e-6)  # every sample has both parts
        files = sorted((sess.run_dir / "rollouts").glob("step_*.jsonl"))
        sample = json.loads(files[-1].read_text().splitlines()[0])
        assert set(sample["reward_parts"]) == {"right", "short"}
        parts = sample["reward_parts"]
        assert sample["reward"] == pytest.approx(parts["right"] + 0.5 * parts["short"])
        inspector = rl.inspect(files[-1])
        assert inspector.columns[-2:] == ("right", "short")
        assert len(inspector.add_filter("short", "==", 1).view()) == sum(
            json.loads(line)["reward_parts"]["short"] == 1 for line in files[-1].read_text().splitlines())
        first, last = sess.evals[0], sess.evals[-1]
        assert first["eval/accuracy"] == pytest.approx(first["eval/part/right"], abs=1e-6)  # float32 vs float mean
        assert summary["eval_before_after"]["part/short"] == [first["eval/part/short"], last["eval/part/short"]]
        assert summary["eval_before_after"]["response_len"] == [first["eval/response_len"], last["eval/response_len"]]

        @sess.reward
        def plain(prompt, response, **_):
            return 1.0
        rescored = sess.score(sess.rollout())
        assert "reward_parts" not in rescored.meta and not any("/part/" in k for k in rescored.info["metrics"])
    page = report_from_run_dir(sess.run_dir).read_text()
    assert "held-out short" in page and "held-out answer length (tokens)" in page
