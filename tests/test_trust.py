"""Trust in the numbers: the rollout engine's log-probs against the trainer's, every step."""
import pytest

import rlbench_nb as rl


@pytest.mark.parametrize("reuse", ["false", "true"])
def test_an_exact_engine_agrees_with_the_trainer_to_float_precision(small_cfg, tmp_path, reuse):
    """HF engine on the CPU in fp32: the sampler's log-probs and the trainer's for the same tokens differ
    only by float32 rounding (a KV-cache decode vs one forward over the sequence sum in other orders:
    ~1e-6 on log-probs of magnitude <= ~10). Measured in prepare (reuse=false) and inside the update's own
    forward (reuse=true)."""
    with rl.Session(small_cfg("run.tensorboard=false", f"algo.reuse_logprobs={reuse}"),
                    run_dir=tmp_path / "run") as sess:
        for _ in range(2):
            row = sess.step()
            assert row["mismatch/logp_abs_max"] < 5e-5, row["mismatch/logp_abs_max"]
            assert row["mismatch/logp_abs_mean"] < 5e-6 and abs(row["mismatch/kl_k3"]) < 1e-8
            assert row["mismatch/alarm"] == 0.0


def test_a_stale_engine_raises_the_alarm_and_tis_reweights(small_cfg, tmp_path, monkeypatch, caplog):
    """The weight push silently skipped (TRL #5312): the engine samples with old weights, the mismatch
    jumps past algo.mismatch_alarm, and truncated IS caps the tokens whose ratio left [0, C]."""
    with rl.Session(small_cfg("run.tensorboard=false", "train.lr=0.02", "algo.rollout_is=tis",
                              "algo.rollout_is_cap=1.5"), run_dir=tmp_path / "run") as sess:
        engine = sess.groups["rollout"].workers[0]
        monkeypatch.setattr(engine, "set_weights", lambda state, version: {"bytes": 0})
        first = sess.step()
        assert first["mismatch/alarm"] == 0.0 and first["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        rows = [sess.step() for _ in range(2)]
        assert rows[-1]["mismatch/alarm"] == 1.0 and rows[-1]["mismatch/logp_abs_mean"] > 0.05
        assert "log-probs differ from the trainer's" in caplog.text
        assert rows[-1]["mismatch/is_capped_frac"] > 0 and rows[-1]["mismatch/is_weight_mean"] != pytest.approx(1.0)


def test_a_weight_push_the_engine_did_not_take_is_caught_on_that_step(small_cfg, tmp_path):
    """Every push is verified: the engine reads back fingerprints of its live weights. Plant the failure
    of TRL #5312 (the load goes into tensors the model does not use) and the step that pushed says so,
    naming rank and tensor; the step is still counted and the next rollout pushes again."""
    from .conftest import assert_rollout_holds_policy_weights
    with rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "run") as sess:
        row = sess.step()
        assert row["sync/verified"] == 1.0 and row["sync/verify_s"] < row["sync/s"]
        engine = sess.groups["rollout"].workers[0]
        engine._targets = {k: v.clone() for k, v in engine._targets.items()}  # copies the model does not use
        with pytest.raises(rl.WeightSyncError, match=r"rollout rank 0 failed in set_weights\(\): after loading "
                                                     r"weights version 2 the engine's '.+' differs from what the "
                                                     r"policy sent"):
            sess.step()
        assert sess.step_count == 2 and sess.state == "ready"
        assert engine.weight_version == 1  # what it is known to hold: the last verified push's step
        sess.workers.push_failed = False  # a controller killed now knew of the failure; one attaching does not ...
        assert sess.workers.expect_weights(sess.step_count)  # ... and finds it in the engine (Session's attach)
        del engine._targets  # repaired: the next rollout's push loads into the model again
        sess.step()
        assert_rollout_holds_policy_weights(sess)
        assert engine.weight_version == sess.step_count == 3 and not sess.workers.expect_weights(3)


def test_the_inspector_colours_tokens_by_the_mismatch(small_cfg, tmp_path):
    with rl.Session(small_cfg("run.tensorboard=false", "algo.reuse_logprobs=false"), run_dir=tmp_path / "run") as sess:
        batch = sess.prepare(sess.score(sess.rollout()))
        toks = sess.inspect(batch).token_colors(0, "Δ log p trainer − engine")
        mask = batch["response_mask_BR"][0].bool()
        expect = (batch["old_logprobs_BR"][0] - batch["rollout_logprobs_BR"][0])[mask].tolist()
        assert [v for _, v in toks] == expect and max(abs(v) for v in expect) < 5e-5


@pytest.fixture
def process_settings_restored():
    """run.deterministic changes this process's thread count and algorithm choice: put them back."""
    import torch
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(strict)


def _weights_after_one_step(cfg, run_dir, *, redone: bool) -> str:
    """A step's weights; `redone`: as a controller killed during the step's rollout and attached again does
    it — the engine sampled once already (its RNG moved on), the data position is the committed one."""
    import hashlib
    with rl.Session(cfg, run_dir=run_dir) as sess:
        if redone:
            committed = sess.progress.sampler.state_dict()
            sess.rollout()  # the rollout the kill cut short
            sess.progress.sampler.load_state_dict(committed)  # what attach reads back from controller_state.json
        sess.step()
        w = sess.groups["policy"].call("get_weights")[0]
        return hashlib.sha256(b"".join(w[k].numpy().tobytes() for k in sorted(w))).hexdigest()


@pytest.mark.usefixtures("process_settings_restored")
def test_deterministic_sampling_does_not_depend_on_draws_that_were_thrown_away(small_cfg, tmp_path):
    """run.deterministic seeds each rollout from (run.seed, its data position): a step redone after an
    interruption gives the weights of a run that was never interrupted. Without it the engine's running RNG
    has moved on, and the weights differ (what makes this test able to fail)."""
    import torch
    for mode in ("true", "false"):
        cfg = small_cfg("run.tensorboard=false", f"run.deterministic={mode}", "task.num_test=8")
        straight = _weights_after_one_step(cfg, tmp_path / f"straight_{mode}", redone=False)
        if mode == "true":
            assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
        redone = _weights_after_one_step(cfg, tmp_path / f"redone_{mode}", redone=True)
        assert (redone == straight) == (mode == "true"), mode
