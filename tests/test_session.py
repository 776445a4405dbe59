"""The in-process (`local` backend) session: phases, weight sync, runs, checkpoints and bad input."""
import json
import subprocess
import sys

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.checkpoint import CheckpointError
from rlbench_nb.data.datasets import DatasetError
from rlbench_nb.metrics import read_jsonl

from .conftest import REPO


def test_each_phase_returns_data_to_look_at(small_cfg):
    sess = rl.Session(small_cfg(), )
    batch = sess.rollout()
    assert len(batch) == 8 * 4 and len(set(batch["group"])) == 8
    assert all(isinstance(r, str) for r in batch["response"])
    assert batch["response_ids_BR"].shape == batch["response_mask_BR"].shape
    # EOS ends a response: nothing after the first EOS is part of it
    ids, mask = batch["response_ids_BR"], batch["response_mask_BR"]
    eos = sess.tokenizer.eos_token_id
    for i in range(len(batch)):
        n = int(mask[i].sum())
        assert mask[i, :n].all() and not mask[i, n:].any()
        assert eos not in ids[i, : n - 1].tolist()
    batch = sess.score(batch)
    assert set(batch["scores_B"].tolist()) <= {0.0, 1.0}
    expected = [float(r.strip() == a) for r, a in zip(batch["response"], batch["answer"])]
    assert batch["scores_B"].tolist() == expected
    batch = sess.prepare(batch)
    assert batch["advantages_BR"].shape == mask.shape
    assert "old_logprobs_BR" not in batch  # the default: one epoch of one mini-batch reuses the update's forward
    stats = sess.update(batch)
    for key in ("reward/mean", "loss/policy", "actor/clip_frac", "actor/grad_norm", "entropy", "time/rollout_s",
                "throughput/rollout_tok_s", "memory/policy_peak_gb", "sync/bytes", "response_len/mean"):
        assert key in stats, key
    # the local backend generates inside the submit call: the clock must start before it (32 samples take ms)
    assert stats["time/rollout_s"] > 1e-3 and stats["throughput/rollout_tok_s"] < 1e6
    assert sess.step_count == 1
    assert stats["memory/policy_peak_gb"] > 0.1 and stats["memory/reward_peak_gb"] > 0.1  # reported by the calls
    rows = read_jsonl(sess.run_dir / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and rows[-1]["reward/mean"] == pytest.approx(stats["reward/mean"])
    assert (sess.run_dir / "config.yaml").exists() and (sess.run_dir / "rollouts" / "step_000001.jsonl").exists()
    assert "policy" in repr(sess) and "<table" in sess._repr_html_()


def test_rollout_logprobs_match_the_trainer(small_cfg):
    """The sampler's log-probs of the tokens it drew equal the policy's: the PPO ratio starts at 1."""
    sess = rl.Session(small_cfg("algo.reuse_logprobs=false"))  # prepare() runs the trainer's forward
    batch = sess.prepare(sess.score(sess.rollout()))
    m = batch["response_mask_BR"].bool()
    torch.testing.assert_close(batch["rollout_logprobs_BR"][m], batch["old_logprobs_BR"][m], atol=1e-4, rtol=1e-4)


def test_update_changes_the_policy_and_the_rollout_engine_follows(small_cfg):
    sess = rl.Session(small_cfg("train.lr=1e-2"))
    policy = sess.groups["policy"].workers[0].model
    rollout = sess.groups["rollout"].workers[0].model
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    probe = sess.prompts.encode(sess.test_data.rows[:16], 1, "probe")
    greedy = sess.cfg.rollout.model_copy(update={"temperature": 0.0})
    lp_before = sess.groups["rollout"].call_split("generate", probe, greedy)["rollout_logprobs_BR"]
    sess.step()
    after = policy.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2, "most parameter tensors should move after one update"
    for k, v in rollout.state_dict().items():
        assert torch.equal(v, after[k]), f"rollout weight {k} was not synced"
    out = sess.groups["rollout"].call_split("generate", probe, greedy)
    lp_after = out["rollout_logprobs_BR"]  # it generates with the new weights:
    assert lp_after.shape != lp_before.shape or not torch.allclose(lp_after, lp_before)
    probe.update(out)
    trainer_lp = sess.groups["policy"].call_split("compute_logprobs", probe)["old_logprobs_BR"]
    m = out["response_mask_BR"].bool()
    torch.testing.assert_close(out["rollout_logprobs_BR"][m], trainer_lp[m], atol=1e-4, rtol=1e-4)


def test_run_writes_summary_rollouts_tensorboard_and_checkpoint(small_cfg):
    sess = rl.Session(small_cfg("run.checkpoint_every=2"))
    summary = sess.run(steps=3, progress=False)
    d = sess.run_dir
    saved = json.loads((d / "summary.json").read_text())
    assert saved["steps"] == 3 and 0 <= saved["accuracy_before"] <= 1 and "accuracy_after" in saved
    assert summary == saved
    rows = [json.loads(line) for line in (d / "rollouts" / "step_000003.jsonl").read_text().splitlines()]
    # the names people see (Batch.shown_fields), the dataset row's fields, the group id, and the token ids a
    # replay rebuilds the batch from (rl.load_rollouts)
    assert len(rows) == 32 and set(rows[0]) == {"prompt", "response", "answer", "reward", "advantage", "length",
                                                "reward_error", "group", "tokens"}
    assert set(rows[0]["tokens"]) == {"prompt", "response", "logprobs", "widths", "pad"}
    assert len(rows[0]["tokens"]["response"]) == rows[0]["length"] == len(rows[0]["tokens"]["logprobs"])
    assert list((d / "tb").glob("events.out.tfevents.*"))
    assert (d / "checkpoints" / "latest").read_text() == "step_3"
    assert {p.name for p in (d / "checkpoints").iterdir()} == {"step_2", "step_3", "latest"}
    evals = [r for r in read_jsonl(d / "metrics.jsonl") if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]


def test_reward_hot_swap_rescoring_and_errors_keep_the_step_going(small_cfg):
    sess = rl.Session(small_cfg())
    batch = sess.score(sess.rollout())

    @sess.reward
    def length_reward(prompt, response, answer):
        if response.startswith("1"):
            raise ValueError("no ones")
        return float(len(response))

    rescored = sess.score(batch)
    for resp, score, err in zip(rescored["response"], rescored["scores_B"].tolist(), rescored["reward_error"]):
        if resp.startswith("1"):
            assert score == 0.0 and "length_reward' ValueError" in err and "no ones" in err
        else:
            assert score == float(len(resp)) and err is None
    n_err = sum(r.startswith("1") for r in batch["response"])
    html = sess.inspect(rescored).table_html()  # the inspector shows each failing sample's error
    assert html.count("length_reward&#x27; ValueError") == n_err
    stats = sess.update(sess.prepare(rescored))
    assert stats["reward/errors"] == n_err


def test_a_reward_that_cannot_be_shipped_is_refused_with_the_reason(small_cfg):
    import threading
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    lock = threading.Lock()

    def locked_reward(prompt, response, answer):
        with lock:
            return 1.0
    with pytest.raises(ValueError, match=r"reward function 'locked_reward' cannot be shipped to the reward workers: "
                                         r"TypeError: cannot pickle '_thread.lock' object"):
        sess.set_reward(locked_reward)
    assert sess.score(sess.rollout())["reward_error"][0] is None  # the old function is still in place


def _strip(rows):
    """Training rows without wall-clock quantities (time, throughput, memory, sync seconds)."""
    drop = ("time/", "throughput/", "memory/", "sync/s", "sync/verify_s")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows if "reward/mean" in r]


RESUME_SCRIPT = """
import sys, transformers
transformers.logging.disable_progress_bar()
import rlbench_nb as rl
mode, arg, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "start":
    sess = rl.Session(rl.Config.load(sys.argv[4]), run_dir=run_dir)
    for _ in range(int(arg)):
        sess.step()
    sess.save("mid")
else:
    sess = rl.Session.load(run_dir)
    for _ in range(int(arg)):
        sess.step()
"""


# Cost ~18 s each: a fresh interpreter loads the checkpoint, so nothing in this process's memory can make the resume
# look exact.
@pytest.mark.parametrize("algo", [
    ["algo.kl_coef=0.05"],                                                                # GRPO + reference KL loss
    ["algo.advantage=gae", "algo.kl_in=reward", "algo.kl_coef=0.02", "algo.kl_ctrl=adaptive",
     "train.mini_batches=2", "train.epochs=2"],                                           # PPO with critic
])
def test_exact_resume_in_a_new_process(small_cfg, tmp_path, algo):
    # the same torch thread count in both processes: parallel reductions round differently with another
    # (and earlier tests may have changed this process's count)
    cfg = small_cfg(*algo, "run.tensorboard=false", "cluster.num_threads=2")
    straight = rl.Session(cfg, run_dir=tmp_path / "straight")
    for _ in range(4):
        straight.step()
    cfg.save(tmp_path / "cfg.yaml")
    resumed_dir = tmp_path / "resumed"
    for mode in ("start", "resume"):
        subprocess.run([sys.executable, "-c", RESUME_SCRIPT, mode, "2", str(resumed_dir), str(tmp_path / "cfg.yaml")],
                       check=True, cwd=REPO, timeout=300)
    a = _strip(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    b = _strip(read_jsonl(resumed_dir / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b


def test_resume_after_later_rows_keeps_them_aside(small_cfg, tmp_path):
    sess = rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "r")
    sess.step()
    sess.save("one")
    sess.step()
    with pytest.raises(rl.RLBenchError, match=r"in use by another session in this process.*take_over=True"):
        rl.Session.load(tmp_path / "r" / "checkpoints" / "one")  # the run is live: loading it would fork it
    assert [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "reward/mean" in r] == [1, 2]
    again = rl.Session.load(tmp_path / "r" / "checkpoints" / "one", take_over=True)
    with pytest.raises(rl.SessionStateError, match="was taken over by another session in this process"):
        sess.step()  # the old session is fenced: it writes nothing more
    assert again.step_count == 1 and [r["step"] for r in again.history] == [1]
    assert [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.superseded.jsonl")] == [2]
    again.step()
    assert [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "reward/mean" in r] == [1, 2]


def test_interrupted_save_never_becomes_latest(small_cfg, tmp_path, monkeypatch):
    sess = rl.Session(small_cfg("run.tensorboard=false"), run_dir=tmp_path / "r")
    sess.step()
    sess.save("good")
    sess.step()

    def crash(*a, **k):
        raise OSError("disk full mid-save")
    monkeypatch.setattr(sess.groups["rollout"].workers[0], "get_state", crash)
    with pytest.raises(rl.cluster.WorkerError):
        sess.save("bad")
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "good"
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["good", "latest"]  # cleaned up
    sess.close()
    assert rl.Session.load(tmp_path / "r").step_count == 1
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        rl.Session.load(tmp_path)


def test_bad_dataset_and_config_fail_before_touching_the_run(small_cfg, tmp_path):
    run_dir = tmp_path / "r"
    sess = rl.Session(small_cfg("run.tensorboard=false"), run_dir=run_dir)
    sess.step()
    sess.save("kept")
    written = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": ""}\n{oops\n')
    with pytest.raises(DatasetError,
                       match=r"bad.jsonl: 0 rows kept, 2 skipped \(row 1: empty 'prompt'; row 2: not valid JSON"):
        rl.Session(small_cfg(f"data.train_path={bad}"), run_dir=run_dir)
    with pytest.raises(rl.ConfigError, match="did you mean 'rollout.temperature'"):
        rl.Session(small_cfg("rollout.temperatur=2"), run_dir=run_dir)
    with pytest.raises(rl.ConfigError, match=r"rollout.max_new_tokens = \d+ tokens, more than the model's \d+ "
                                             r"positions \(max_position_embeddings in .*\): lower them"):
        rl.Session(small_cfg("rollout.max_new_tokens=100000"), run_dir=run_dir)
    # rows handed to a phase, an unscored batch, a checkpoint name the run lacks: refused before a worker runs
    with pytest.raises(DatasetError, match=r"sess.rollout\(rows\): rows\[1\]: missing field 'prompt' \(fields: "
                                           r"\['promt'\]\); rows\[2\]: has a field named 'group'.*e.g. \[\{'prompt'"):
        sess.rollout([{"prompt": "1+1="}, {"promt": "2+2="}, {"prompt": "3+3=", "group": "easy"}])
    with pytest.raises(DatasetError, match=r"sess.evaluate\(rows\): rows\[0\]: prompt has \d+ characters: more than "
                                           r"data.max_prompt_len=\d+ tokens can hold"):
        sess.evaluate([{"prompt": "1+1=" * 1000, "answer": "2"}])
    with pytest.raises(DatasetError, match=r"sess.rollout\(rows\) takes a list of rows.*got dict"):
        sess.rollout({"prompt": "1+1="})
    with pytest.raises(rl.UsageError, match=r"needs a scored batch.*sess.prepare\(sess.score\(batch\)\)"):
        sess.prepare(sess.rollout([{"prompt": "1+1=", "answer": "2"}]))
    with pytest.raises(rl.CheckpointError, match=r"no checkpoint 'kept_not'.*this run's checkpoints: \['kept'\]"):
        sess.load("kept_not")
    wrong = {  # a notebook's wrong variable: named with what to pass, not an AttributeError deep inside
        r"sess.score\(batch\) takes a batch from sess.rollout\(\), got list": lambda: sess.score([1, 2]),
        r"sess.restore\(snap\) takes a snapshot.*got str; a checkpoint is sess.load": lambda: sess.restore("kept"),
        r"sess.replay\(batch\) takes a batch.*got int": lambda: sess.replay(42),
        r"sess.adopt\(branch\) takes a branch from sess.fork": lambda: sess.adopt("kept"),
        r"sess.compare takes branches .* or replays .*got int": lambda: sess.compare(1),
        r"max_new_tokens=0: a whole number of tokens, 1 or more": lambda: sess.evaluate(max_new_tokens=0),
        r"max_new_tokens=100000 .* more than the model's \d+ positions: at most \d+":
            lambda: sess.evaluate(max_new_tokens=100_000),
        r"steps='5': a whole number of steps": lambda: sess.run("5"),
        r"sess.inspect takes a batch .* or a rollouts file, got int": lambda: sess.inspect(3),
        r"max_points=0: how many points each curve keeps, 2 or more": lambda: sess.dashboard(max_points=0),
    }
    for message, call in wrong.items():
        with pytest.raises(rl.UsageError, match=message):
            call()
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == written
    sess.step()
    assert sess.load("latest").step_count == 1  # "latest" is the run's latest checkpoint, as None is
    sess.close()


def test_jsonl_dataset_with_some_bad_rows_trains(small_cfg, tmp_path):
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(20)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([json.dumps(r) for r in rows] + ['{"answer": "3"}', "not json"]) + "\n")
    (tmp_path / "test.jsonl").write_text(path.read_text())
    sess = rl.Session(small_cfg(f"data.train_path={path}", f"data.test_path={tmp_path / 'test.jsonl'}",
                                "data.test_size=21"))
    assert len(sess.train_data) == 20 and [p.row for p in sess.train_data.problems] == [21, 22]
    # data.test_size: the file's first 21 rows, the bad one among them reported, the one after not read
    assert len(sess.test_data) == 20 and [p.row for p in sess.test_data.problems] == [21]
    batch = sess.rollout()
    assert set(batch["prompt"]) <= {r["prompt"] for r in rows}
    sess.update(sess.prepare(sess.score(batch)))


def test_local_model_dir_with_chat_template(small_cfg, tmp_path):
    """Any local HF directory loads the same way; its chat template wraps the prompts."""
    base = rl.Session(small_cfg("run.tensorboard=false"))
    model_dir = tmp_path / "my-model"
    base.groups["policy"].workers[0].model.save_pretrained(str(model_dir))
    tok = base.tokenizer
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %} {% endif %}")
    tok.save_pretrained(str(model_dir))
    sess = rl.Session(small_cfg(f"model.path={model_dir}", "run.tensorboard=false"))
    assert sess.task.model_dir == model_dir
    batch = sess.rollout()
    first = sess.tokenizer.decode(batch["prompt_ids_BP"][0][batch["prompt_mask_BP"][0].bool()])
    assert first == batch["prompt"][0] + " "  # the template's generation prompt was added
    sess.update(sess.prepare(sess.score(batch)))


def test_non_finite_loss_skips_the_update_and_keeps_weights(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    batch = sess.prepare(sess.score(sess.rollout()))
    policy = sess.groups["policy"].workers[0]
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    batch["advantages_BR"] = torch.full_like(batch["advantages_BR"], float("nan"))
    stats = sess.update(batch)
    assert stats["update/skipped"] == 1 and stats["update/skipped_nonfinite_loss"] == 1
    assert all(torch.equal(v, policy.model.state_dict()[k]) for k, v in before.items())
    assert not policy.optimizer.state  # Adam moments untouched too


def test_consecutive_skipped_updates_stop_the_run_and_keep_every_row(small_cfg, caplog):
    sess = rl.Session(small_cfg("run.tensorboard=false", "train.max_skipped_steps=3"))
    sess.step()
    # an estimator from a cell that goes NaN on a real batch (its two-sample trial passes): every update's loss is NaN
    @sess.advantage
    def diverging(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg):
        return rewards_BR * (float("nan") if len(group_ids) > 2 else 1.0) * mask_BR, None

    sess.configure("algo.advantage=diverging")
    with pytest.raises(FloatingPointError, match=r"skipped 3 steps in a row \(up to step 4\): non-finite loss"):
        sess.run(10, progress=False)
    assert "step 2: policy: 1 of 1 optimizer step(s) skipped: non-finite loss" in caplog.text
    rows = [r for r in read_jsonl(sess.run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["update/skipped"] == 1 for r in rows[1:])
    sess.close()


def test_a_batch_prepared_to_reuse_its_forward_is_refused_once_weights_or_settings_moved(small_cfg):
    """The default takes the old log-probs from the update's own forward, which is right only for the weights and
    settings prepare() saw: after an update, or with two mini-batches, the update would see ratio 1 where it
    must not. It says to prepare again; a batch prepared before keeps no stale old log-probs either."""
    with rl.Session(small_cfg("run.tensorboard=false", "train.lr=1e-2")) as sess:
        prepared = sess.prepare(sess.score(sess.rollout()))
        assert "old_logprobs_BR" not in prepared
        sess.update(prepared)
        with pytest.raises(rl.UsageError, match=r"prepare it again, sess.update\(sess.prepare\(batch\)\)"):
            sess.update(prepared)  # the weights moved since prepare()
        again = sess.prepare(prepared)
        sess.configure("train.mini_batches=2")
        with pytest.raises(rl.UsageError, match="prepare it again"):
            sess.update(again)  # two optimizer steps: the second needs the log-probs of before the first
        separate = sess.prepare(again)
        assert "old_logprobs_BR" in separate  # now prepare() runs the forward
        sess.update(separate)
        sess.configure("train.mini_batches=1")
        assert "old_logprobs_BR" not in sess.prepare(separate)  # stale: from weights two updates ago
        assert sess.step_count == 2


def test_a_run_remembers_its_tokenizer_class_and_model_positions_load_without_model_modules(small_cfg, tmp_path,
                                                                                               monkeypatch):
    """A re-attaching controller loads no model: it reads the model's positions from config.json and its
    tokenizer by the class AutoTokenizer chose for the run (both would otherwise import transformers' model
    modules, ~3 s of its start); a new run on the same folder, by the class the cache remembers. The same
    tokenizer either way; AutoTokenizer again when the folder, its
    configs or the transformers version differ; AutoConfig when config.json does not name
    max_position_embeddings (GPT-2: n_positions)."""
    import transformers
    from transformers import AutoTokenizer, GPT2Config

    from rlbench_nb.data.tasks import Task
    from rlbench_nb.prompts import TOKENIZER_CLASS_FILE, _cached_choice, load_tokenizer
    sess = rl.Session(small_cfg())
    run_dir, model_dir, auto = sess.run_dir, str(sess.task.model_dir), sess.tokenizer
    assert sess.task.max_positions == transformers.AutoConfig.from_pretrained(model_dir).max_position_embeddings
    sess.close()
    remembered = json.loads((run_dir / TOKENIZER_CLASS_FILE).read_text())
    assert (remembered["class"], remembered["model_dir"], remembered["transformers"]) == (
        type(auto).__name__, model_dir, transformers.__version__)

    def no_auto(*args, **kwargs):
        raise AssertionError("AutoTokenizer was used")
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_auto)
    direct = load_tokenizer(model_dir, run_dir)
    text = "12+34=46<eos> 7*8"
    assert type(direct) is type(auto) and direct.encode(text) == auto.encode(text)
    assert direct.get_vocab() == auto.get_vocab() and direct.all_special_ids == auto.all_special_ids
    assert (direct.pad_token_id, direct.eos_token_id, direct.padding_side) == (auto.pad_token_id, auto.eos_token_id,
                                                                              auto.padding_side)
    new_run = load_tokenizer(model_dir, tmp_path / "a-new-run")  # a new run on the same folder: the cache's entry
    assert type(new_run) is type(auto) and new_run.encode(text) == auto.encode(text)
    for changed in ({"transformers": "0.0.1"}, {"model_dir": str(tmp_path)}, {"configs": "edited since"}):
        for where in (run_dir / TOKENIZER_CLASS_FILE, _cached_choice(model_dir)):
            where.write_text(json.dumps({**remembered, **changed}))
        with pytest.raises(AssertionError, match="AutoTokenizer was used"):
            load_tokenizer(model_dir, run_dir)
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_positions=77, n_layer=1, n_embd=8, n_head=2).save_pretrained(gpt2)
    assert Task("t", gpt2, [], [], len).max_positions == 77
