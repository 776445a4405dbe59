"""The research loop inside a live session: snapshot and restore, branches that leave the main line
untouched, replays of saved steps, re-scoring, and RL functions swapped from a cell (local backend; the
Ray and FSDP versions are in tests/cluster/test_ray_backend.py)."""
import copy
import threading

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.algos import agg_loss
from rlbench_nb.metrics import read_jsonl

from .conftest import assert_rollout_holds_policy_weights

# wall-clock quantities differ run to run; everything else in a row is a function of the state
VOLATILE = ("time/", "throughput/", "memory/", "sync/s", "sync/verify_s")


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _state_digest(sess) -> dict:
    """What a step depends on, read from the (in-process) workers: weights, optimizer state, RNG, data."""
    policy = sess.groups["policy"].workers[0]
    optim = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
             for i, st in enumerate(policy.optimizer.state.values())}
    return {"weights": {k: v.clone() for k, v in policy.model.state_dict().items()}, "optim": optim,
            "lr": [g["lr"] for g in policy.optimizer.param_groups], "rng": torch.get_rng_state().clone(),
            "data": sess.progress.sampler.state_dict(), "step": sess.step_count, "cfg": sess.cfg.to_dict()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def test_stepping_from_a_restored_snapshot_is_bit_identical(small_cfg, tmp_path):
    with rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run") as sess:
        sess.step()
        snap = sess.snapshot()
        assert snap.bytes > 0 and "in memory" in repr(snap)
        at_one = sess.rundir.read_state()
        first = [_numbers(sess.step()) for _ in range(3)]
        weights = sess.groups["policy"].call("get_weights")[0]
        sess.restore(snap)
        assert sess.step_count == 1 and [r["step"] for r in sess.history] == [1]
        # controller_state.json follows the restore: a controller killed now re-attaches at step 1, not 4
        assert sess.rundir.read_state() == at_one and at_one["step"] == 1
        again = [_numbers(sess.step()) for _ in range(3)]
        assert again == first  # every number of every row, bit for bit
        assert all(torch.equal(v, sess.groups["policy"].call("get_weights")[0][k]) for k, v in weights.items())
        assert_rollout_holds_policy_weights(sess)
        assert sess.groups["policy"].call("adam_steps")[0] == sess.step_count == 4
        # the rows the restore undid are kept aside, as a checkpoint load does
        assert [r["step"] for r in read_jsonl(sess.run_dir / "metrics.superseded.jsonl")] == [2, 3, 4]
        on_disk = sess.snapshot(to_disk=True)
        assert (sess.run_dir / "snapshots" / on_disk.key).is_dir()
        at_four = sess.groups["policy"].call("get_weights")[0]
        sess.save("five")
        sess.step()
        sess.restart("policy")  # new policy workers (from checkpoint "five"): a snapshot on disk still restores
        sess.restore(on_disk)
        assert sess.step_count == 4
        assert all(torch.equal(v, sess.groups["policy"].call("get_weights")[0][k]) for k, v in at_four.items())
        assert_rollout_holds_policy_weights(sess)
        with pytest.raises(rl.WorkerError, match="holds no snapshot .*restarted since it was taken"):
            sess.restore(snap)  # the one in memory went with the old workers
        snap.release()
        with pytest.raises(rl.SnapshotError, match="released"):
            sess.restore(snap)
        on_disk.release()
        assert not (sess.run_dir / "snapshots" / on_disk.key).exists()


def test_a_fork_leaves_the_main_line_untouched_and_adopt_continues_from_it(small_cfg, tmp_path):
    with rl.Session(small_cfg("run.tensorboard=false", "run.checkpoint_every=7"), run_dir=tmp_path / "run") as sess:
        sess.step()
        snap = sess.snapshot()
        straight = _numbers(sess.step())  # what the main line's next step is
        sess.restore(snap)
        before, main_rows = _state_digest(sess), (sess.run_dir / "metrics.jsonl").read_text()
        b = sess.fork("lr-high", 3, "train.lr=1e-3", "algo.clip_high=0.28", progress=False)
        assert _same(_state_digest(sess), before)  # weights, optimizer, lr, RNG, data position, step, config
        # the branch's run is not the main line's
        assert (sess.progress.run_target, sess.progress.run_outcome) == (None, None)
        assert (sess.run_dir / "metrics.jsonl").read_text() == main_rows  # the branch wrote elsewhere
        assert [r["step"] for r in b.history] == [2, 3, 4] and b.cfg.train.lr == 1e-3
        assert [r["step"] for r in read_jsonl(b.path / "metrics.jsonl") if "reward/mean" in r] == [2, 3, 4]
        assert b.evals and b.evals[-1]["step"] == 4  # the branch's own end-of-run evaluation
        assert _numbers(sess.step()) == straight  # the main line goes on as if nothing happened
        assert_rollout_holds_policy_weights(sess)
        # a branch with the same settings as the main line is the main line: same rows
        sess.restore(snap)
        same = sess.fork("same", 1, progress=False)
        assert {k: v for k, v in _numbers(same.history[0]).items() if k != "step"} == straight
        # adopt: the main line continues from the branch's end, with its settings and rows
        sess.adopt(b)
        assert sess.step_count == 4 and sess.cfg.train.lr == 1e-3 and b.end is None
        assert sess.cfg.run.checkpoint_every == 7 and not (b.path / "checkpoints").exists()  # a branch saves none
        assert [r["step"] for r in sess.history] == [1, 2, 3, 4]
        assert sess.groups["policy"].workers[0].optimizer.param_groups[0]["lr"] == 1e-3
        assert sess.groups["policy"].call("adam_steps")[0] == 4


def test_a_branch_refuses_what_would_change_shapes_roles_or_data(small_cfg, tmp_path):
    with rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run") as sess:
        with pytest.raises(rl.ConfigError, match="a branch cannot change 'model.dtype'"):
            sess.fork("x", 1, "model.dtype=bfloat16")
        with pytest.raises(rl.ConfigError, match="a branch asks for settings that need a reference model, and this"):
            sess.fork("x", 1, "algo.kl_coef=0.1")
        with pytest.raises(rl.ConfigError, match="a branch cannot change 'data.train_path'"):
            sess.fork("x", 1, "data.train_path=other.jsonl")
        with pytest.raises(rl.UsageError, match="branch name '../x' is not allowed"):
            sess.fork("../x", 1)
        with pytest.raises(rl.ConfigError, match="sess.configure cannot change 'model.dtype'"):  # not "a branch"
            sess.configure("model.dtype=bfloat16")
        with pytest.raises(rl.UsageError, match=r"rows=0: how many training prompts to check, 1 or more"):
            sess.doctor(rows=0)
        assert sess.step_count == 0 and sess.state == "ready" and not sess.branches


def test_replaying_a_saved_step_from_the_checkpoint_before_it_gives_the_same_update(small_cfg, tmp_path):
    with rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run") as sess:
        sess.step()
        sess.save("one")
        original = _numbers(sess.step())
        weights_after = sess.groups["policy"].call("get_weights")[0]
        sess.load("one")
        saved = rl.load_rollouts(sess.run_dir / "rollouts" / "step_000002.jsonl")
        r = sess.replay(saved)
        shared = (original.keys() & r.row.keys()) - {"step"}
        assert {"loss/policy", "actor/grad_norm", "advantage/abs_max", "entropy"} <= shared
        assert {k: r.row[k] for k in shared} == {k: original[k] for k in shared}  # bit for bit
        assert sess.step_count == 1  # the replay ran on a branch: the session is back at step 1
        # its weight change is the original step's: |W2 - W1| / |W1| per parameter
        before = sess.groups["policy"].call("get_weights")[0]
        largest = r.largest_changes(3)
        assert len(largest) == 3 and largest[0][1] >= largest[1][1] >= largest[2][1] > 0
        for k, v in largest:
            expect = ((weights_after[k].double() - before[k].double()).norm() / before[k].double().norm()).item()
            assert v == pytest.approx(expect, rel=1e-6), k  # float64 sums of the same float32 numbers


def test_rescoring_saved_rollouts_keeps_the_old_reward_beside_the_new(small_cfg, tmp_path):
    with rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run") as sess:
        sess.step()
        saved = rl.load_rollouts(sess.run_dir / "rollouts" / "step_000001.jsonl")

        def shorter_is_better(prompt, response, answer):
            return 1.0 / (1 + len(response))
        sess.set_reward(shorter_is_better)
        again = sess.score(saved)
        expect = torch.tensor([1.0 / (1 + len(x)) for x in saved["response"]])
        assert torch.allclose(again["scores_B"], expect) and torch.equal(again["scores_before_B"], saved["scores_B"])
        rows = sess.inspect(again).rows
        assert rows[0]["reward_before"] == saved["scores_B"][0].item() and rows[0]["reward"] == pytest.approx(
            expect[0].item())
    with pytest.raises(rl.RLBenchError, match="holds no rollouts"):
        (tmp_path / "empty.jsonl").write_text("")
        rl.load_rollouts(tmp_path / "empty.jsonl")


def test_a_custom_advantage_and_loss_change_the_update_as_computed_by_hand(small_cfg, tmp_path):
    with rl.Session(small_cfg("run.tensorboard=false", "algo.reuse_logprobs=false"),
                    run_dir=tmp_path / "run") as sess:

        @sess.advantage
        def doubled(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg):
            return 2 * rewards_BR.sum(-1, keepdim=True) * mask_BR, None

        @sess.policy_loss
        def reinforce(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg):
            return -advantages_BR * logprobs_BR, {"adv_mean": float((advantages_BR * mask_BR).sum() / mask_BR.sum())}

        batch = sess.score(sess.rollout())
        policy = sess.groups["policy"].workers[0]
        scorer = copy.deepcopy(policy.scorer)  # the policy as it is, to compute the update by hand
        sess.configure("algo.advantage=doubled")
        prepared = sess.prepare(batch)
        mask = batch["response_mask_BR"].float()
        assert torch.equal(prepared["advantages_BR"], 2 * batch["scores_B"][:, None] * mask)
        r = sess.replay(prepared, "algo.policy_loss=reinforce")
        lp, _ = scorer(batch["prompt_ids_BP"], batch["prompt_mask_BP"], batch["response_ids_BR"],
                       batch["response_mask_BR"], with_entropy=False)
        loss = agg_loss(-prepared["advantages_BR"] * lp, mask, "token-mean")
        loss.backward()
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in scorer.parameters() if p.grad is not None])
        # micro-batches add their shares of the same sum in another order: float32 rounding, ~1e-7 relative
        assert r.row["loss/policy"] == pytest.approx(loss.item(), rel=1e-5)
        assert r.row["actor/grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
        # a loss's own statistics come back as token-weighted means over the batch (actor/<name>)
        assert r.row["actor/adv_mean"] == pytest.approx(float((prepared["advantages_BR"] * mask).sum() / mask.sum()),
                                                        rel=1e-5)
        ppo = sess.replay(prepared)  # the built-in loss on the same batch moves the weights differently
        assert ppo.row["loss/policy"] != r.row["loss/policy"]
        assert sess.cfg.algo.policy_loss == "ppo" and sess.step_count == 0


def test_functions_that_cannot_be_used_are_refused_with_the_reason(small_cfg, tmp_path):
    with rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run") as sess:
        lock = threading.Lock()

        def locked(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg):
            with lock:
                return -advantages_BR * logprobs_BR
        with pytest.raises(rl.UsageError, match="policy loss 'locked' cannot be shipped to the policy workers: "
                                                "TypeError: cannot pickle '_thread.lock' object"):
            sess.policy_loss(locked)

        def per_sequence(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg):
            return (-advantages_BR * logprobs_BR).sum(-1)
        with pytest.raises(rl.UsageError, match=r"must return a \[B, R\] tensor \(here \(2, 3\)\); got \(2,\)"):
            sess.policy_loss(per_sequence)

        def detached(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg):
            return -advantages_BR * logprobs_BR.detach()
        with pytest.raises(rl.UsageError, match="does not depend on logprobs_BR"):
            sess.policy_loss(detached)

        def broken(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg):
            return rewards_BR / cfg.no_such_field, None
        with pytest.raises(rl.UsageError, match="advantage estimator 'broken' fails on a two-sample batch: "
                                                "AttributeError"):
            sess.advantage(broken)
        with pytest.raises(rl.ConfigError, match="unknown estimator; known: .*register yours with @sess.advantage"):
            sess.configure("algo.advantage=broken")
