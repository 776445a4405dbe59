"""`sess.doctor()` and `rlbench-nb doctor`: every check passes on a healthy session, which is left exactly as
it was, and each check fails on its own fault, planted for real in the live workers (an engine left on stale
weights, log-probs zero-filled, an engine that does not stop at the tokenizer's EOS, a reward that changes
between calls, a chat template that loses the prompt, dropout in the trainer, an optimizer that moves weights
at learning rate 0, a reference that is not the starting policy, settings that do nothing)."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.doctor import idle_settings

from .conftest import REPO, SMALL

CONFIG = str(REPO / "configs/arith_grpo.yaml")


@pytest.fixture(scope="module")
def sess(tmp_path_factory, warm_start_cache):
    """One session for the module (its doctor leaves it as it was): a reference model too (a KL loss)."""
    run_dir = tmp_path_factory.mktemp("doctor") / "run"
    with rl.Session(CONFIG, [*SMALL, "run.tensorboard=false", "algo.kl_coef=0.01"], run_dir=run_dir) as s:
        yield s


def _weights(sess) -> dict:
    return {k: v.clone() for k, v in sess.groups["policy"].workers[0].model.state_dict().items()}


def _verdicts(report) -> dict[str, bool | None]:
    return {c.name: c.ok for c in report.checks}


def test_a_healthy_session_passes_every_check_and_is_left_as_it_was(sess):
    state, weights, rows = sess.controller_state(), _weights(sess), len(sess.history)
    engine = sess.groups["rollout"].workers[0].model.state_dict()["lm_head.weight"].clone()
    report = sess.doctor()
    print(report)
    assert report.ok, str(report)
    verdicts = _verdicts(report)
    for name in ("the update's forward equals prepare's (ratio 1)", "KL to the reference at step 0",
                 "engine and trainer log-probs agree", "an update at lr 0 moves no weight",
                 "the weight push is verified", "the reward gives the same score twice",
                 "responses end at EOS or the length cap", "no zero-filled log-probs",
                 "prompts survive the chat template", "settings that do something"):
        assert verdicts[name] is True, (name, str(report))  # each one measured here, none skipped
    assert sess.controller_state() == state and len(sess.history) == rows  # step, data position, KL controller
    after = _weights(sess)
    assert all(torch.equal(after[k], v) for k, v in weights.items())
    assert torch.equal(sess.groups["rollout"].workers[0].model.state_dict()["lm_head.weight"], engine)
    assert not (sess.run_dir / "branches" / "doctor").exists() and "doctor" not in sess.branches
    assert "all" in str(report).splitlines()[-1] and "passed" in str(report).splitlines()[-1]


def test_rollouts_on_stale_weights_are_caught(sess, monkeypatch):
    """The push after an update did not land (TRL #5312): the engine samples from the old weights."""
    monkeypatch.setattr(sess.workers, "sync", lambda *a, **k: {})
    for _ in range(3):
        sess.step()
    report = sess.doctor()
    check = report["engine and trainer log-probs agree"]
    assert check.ok is False and "stale" in check.fix, str(report)
    assert report["the weight push is verified"].ok is None  # nothing was pushed: not claimed verified
    monkeypatch.undo()
    sess.sync_weights()
    assert sess.doctor()["engine and trainer log-probs agree"].ok is True


def _corrupt_rollouts(sess, monkeypatch, corrupt) -> None:
    engine = sess.groups["rollout"].workers[0]
    generate = engine.generate

    def corrupted(*args, **kwargs):
        out = generate(*args, **kwargs)
        corrupt(out)
        return out
    monkeypatch.setattr(engine, "generate", corrupted)


def test_zero_filled_log_probs_are_caught(sess, monkeypatch):
    """NeMo-RL #4218: missing log-probs filled with 0, so every importance ratio is off."""
    _corrupt_rollouts(sess, monkeypatch, lambda out: out["rollout_logprobs_BR"].zero_())
    report = sess.doctor()
    assert report["no zero-filled log-probs"].ok is False, str(report)
    assert report["sampled log-probs are finite and <= 0"].ok is True  # 0 is a valid log-prob on its own


@pytest.mark.parametrize("fault", ["nan", "positive", "outside the vocabulary"])
def test_log_probs_that_are_not_log_probs_and_ids_outside_the_vocabulary_are_caught(sess, monkeypatch, fault):
    vocab = len(sess.tokenizer)

    def corrupt(out):
        if fault == "nan":
            out["rollout_logprobs_BR"][0, 0] = float("nan")
        elif fault == "positive":
            out["rollout_logprobs_BR"][:, 0] = out["rollout_logprobs_BR"][:, 0].abs() + 0.5
        else:
            out["response_ids_BR"][0, 0] = vocab + 3
    _corrupt_rollouts(sess, monkeypatch, corrupt)
    report = sess.doctor()
    name = ("sampled ids are in the vocabulary" if fault == "outside the vocabulary"
            else "sampled log-probs are finite and <= 0")
    assert report[name].ok is False, str(report)
    if fault == "outside the vocabulary":  # the trainer cannot embed it: the step stops there, named
        assert report["a step at lr 0 on these samples (prepare)"].ok is False, str(report)


def test_an_engine_that_does_not_stop_at_the_tokenizers_eos_is_caught(sess, monkeypatch):
    """The engine's EOS is not the tokenizer's (a generation_config.json that disagrees): responses run on
    past the end of the answer."""
    monkeypatch.setattr(sess.groups["rollout"].workers[0], "eos", -1)  # an id no token has
    report = sess.doctor()
    check = report["responses end at EOS or the length cap"]
    assert check.ok is False and "16 hold EOS or the pad token inside" in check.detail, str(report)


def test_a_reward_that_changes_between_calls_is_caught(sess):
    keep = sess.reward_fn
    sess.set_reward(lambda prompt, response, answer: random.random())
    try:
        report = sess.doctor()
    finally:
        sess.set_reward(keep)
    check = report["the reward gives the same score twice"]
    assert check.ok is False and "16 of 16" in check.detail, str(report)  # 4 prompts x rollout.n 4


def test_a_reward_that_raises_is_caught(sess):
    keep = sess.reward_fn

    def strict(prompt, response, answer):
        raise ValueError(f"not a number: {response!r}")
    sess.set_reward(strict)
    try:
        report = sess.doctor()
    finally:
        sess.set_reward(keep)
    check = report["the reward scores every sample"]
    assert check.ok is False and "not a number" in check.detail, str(report)


def test_a_chat_template_that_loses_the_prompt_is_caught(sess):
    tok = sess.prompts.tokenizer
    keep = getattr(tok, "chat_template", None)
    tok.chat_template = "{% for m in messages %}{{ m['text'] }}{% endfor %}"  # written for other message keys
    try:
        report = sess.doctor()
    finally:
        tok.chat_template = keep
    assert report["prompts survive the chat template"].ok is False, str(report)
    assert report["a step at lr 0 on these samples (rollout)"].ok is False  # empty prompts: the engine refuses


def test_dropout_in_the_trainer_is_caught(sess):
    """The update's forward runs in train mode: with dropout on, its log-probs are not prepare's."""
    model = sess.groups["policy"].workers[0].model
    attention = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert attention
    for m in attention:
        m.attention_dropout = 0.3
    try:
        report = sess.doctor()
    finally:
        for m in attention:
            m.attention_dropout = 0.0
    assert report["the update's forward equals prepare's (ratio 1)"].ok is False, str(report)


def test_an_optimizer_that_moves_weights_at_lr_0_is_caught(sess, monkeypatch):
    policy = sess.groups["policy"].workers[0]
    step = policy.optimizer.step

    def decaying(*args, **kwargs):  # weight decay applied apart from the learning rate
        out = step(*args, **kwargs)
        with torch.no_grad():
            for p in policy.model.parameters():
                p.mul_(0.999)
        return out
    snap = sess.snapshot()
    monkeypatch.setattr(policy.optimizer, "step", decaying)
    try:
        report = sess.doctor()
    finally:
        monkeypatch.undo()
    assert report["an update at lr 0 moves no weight"].ok is False, str(report)
    sess.restore(snap)
    snap.release()


def test_a_reference_that_is_not_the_starting_policy_is_caught(small_cfg):
    with rl.Session(small_cfg("run.tensorboard=false", "algo.kl_coef=0.01")) as fresh:
        with torch.no_grad():
            for p in fresh.groups["reference"].workers[0].model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        report = fresh.doctor()
    check = report["KL to the reference at step 0"]
    assert check.ok is False and "kl/ref" in check.detail, str(report)


def test_settings_that_do_nothing_are_named():
    load = rl.Config.load
    assert idle_settings(load(CONFIG))[0].ok is True
    named = {c.name: c for c in idle_settings(load(CONFIG, ["algo.target_kl=0.5", "algo.rollout_is_cap=3",
                                                            "model.lora.alpha=64", "algo.lam=0.9"]))}
    assert all(c.ok is False for c in named.values())
    text = " ".join(named)
    for key in ("algo.target_kl", "algo.rollout_is_cap", "model.lora.alpha", "algo.lam"):
        assert key in text, (key, text)
    fixed = idle_settings(load(CONFIG, ["algo.kl_coef=0.01", "algo.target_kl=0.5"]))
    assert "algo.target_kl" in fixed[0].name and "kl_ctrl=fixed" in fixed[0].detail
    assert idle_settings(load(CONFIG, ["algo.kl_coef=0.01", "algo.kl_ctrl=adaptive", "algo.target_kl=0.5"]))[0].ok


# Cost ~15 s: two `rlbench-nb doctor` subprocesses (a pass and a planted failure): the exit codes a CI job reads.
def test_the_doctor_command_prints_its_checks_and_says_pass_or_fail_by_its_exit_code(tmp_path):
    run = [sys.executable, "-m", "rlbench_nb.cli", "doctor", CONFIG, *SMALL]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "engine and trainer log-probs agree" in done.stdout and "checks passed" in done.stdout
    assert not list(tmp_path.iterdir())  # its run directory was temporary
    done = subprocess.run([*run, "algo.target_kl=0.5"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1 and "FAIL settings that do something: algo.target_kl" in done.stdout, done.stdout


@pytest.mark.parametrize("rollout_dtype", ["model", "bfloat16"])
def test_an_adapter_the_engine_does_not_load_is_caught(tmp_path, rollout_dtype):
    """verl #7495: the LoRA adapter trains, but the engine samples from the base model without it. A bf16 engine
    under the fp32 trainer too, whose rounding alone moves its log-probs off the base model's."""
    cfg = rl.Config.load(str(REPO / "configs/arith_grpo_lora.yaml"),
                         [f"run.dir={tmp_path / 'runs'}", *SMALL, "run.tensorboard=false",
                          f"rollout.dtype={rollout_dtype}"])
    name = "the LoRA adapter reaches the engine"
    with rl.Session(cfg) as lora:
        engine = lora.groups["rollout"].workers[0].model
        base = {k: v.clone() for k, v in engine.state_dict().items()}  # adapters start at zero: the base model
        assert lora.doctor()[name].ok is None  # nothing to see yet
        for _ in range(8):
            lora.step()
        report = lora.doctor()
        assert report.ok and report[name].ok is True, str(report)
        engine.load_state_dict(base)  # the push dropped the adapter
        report = lora.doctor()
    assert report[name].ok is False and "base model" in report[name].fix, str(report)
    if rollout_dtype == "model":  # a bf16 engine's bound is algo.mismatch_alarm's, above a small adapter's move
        assert report["engine and trainer log-probs agree"].ok is False
