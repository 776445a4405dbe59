"""The reward-model role: a sequence classifier with its own tokenizer and chat template scores the
policy's decoded responses beside the rule function, and the two combine by weight."""
import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.data.batch import Batch
from rlbench_nb.roles.reward_model import RewardModelWorker

from ..chat_model import make_reward_model

CORPUS = [f"{a}+{b}={a + b}" for a in range(50) for b in range(50)][::7] + ["You are a helpful assistant."]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_reward_model(tmp_path_factory.mktemp("rm"), CORPUS)


def test_scores_are_the_models_own_forward_on_its_chat_template(rm_dir, small_cfg):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    cfg = small_cfg(f"reward.model.path={rm_dir}", "reward.model.micro_batch_size=3")
    worker = RewardModelWorker(cfg)
    batch = Batch(meta={"prompt": ["12+30=", "7+8=", "40+2=", "1+1="], "response": ["42", "15", "4", "2"]})
    got = worker.score(batch)["rm_scores_B"]
    # the reference: the HF model alone, one sample at a time (no padding), on the ChatML text its template makes
    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()
    text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n12+30=<|im_end|>\n" \
           "<|im_start|>assistant\n42<|im_end|>\n"
    assert worker.texts(batch)[0] == text
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for t in worker.texts(batch)]
    # padded micro-batches (3 + 1) against unpadded singles: the same math on other matrix shapes, so fp32
    # rounding differs in the last bits (~1e-6 relative); 1e-4 holds on any CPU and still catches a score read
    # from a pad token or another sample
    assert got.tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert len(set(round(x, 4) for x in want)) == 4  # the samples score differently: the check can fail
    plain = RewardModelWorker(cfg.override("reward.model.chat_template=off"))
    assert plain.texts(batch)[1] == "7+8=15"


def test_session_combines_rule_and_model_by_weight(rm_dir, small_cfg):
    sess = rl.Session(small_cfg(f"reward.model.path={rm_dir}", "reward.model.weight=0.5", "reward.rule_weight=2.0",
                                "run.tensorboard=false"))
    try:
        scored = sess.score(sess.rollout())
        rule, model = scored["rule_scores_B"], scored["rm_scores_B"]
        assert set(rule.tolist()) <= {0.0, 1.0} and model.std() > 0  # the verifier, and a real model's scores
        assert torch.equal(scored["scores_B"], 2.0 * rule + 0.5 * model)
        m = scored.info["metrics"]
        assert m["reward/rule"] == pytest.approx(rule.mean().item()) and m["reward/model"] == pytest.approx(
            model.mean().item())
        assert {"reward_model", "reward_rule"} <= set(scored.rows()[0])  # shown in the inspector and rollout files
        row = sess.update(sess.prepare(scored))
        assert "reward/model" in row and any(rec.role == "reward_model" for rec in sess.groups["reward_model"].records)
        assert sess.evaluate()["eval/n"] == 40  # evaluation stays the verifier's
    finally:
        sess.close()


def test_a_model_that_is_not_a_reward_model_is_refused(tmp_path, small_cfg):
    two = make_reward_model(tmp_path / "two", CORPUS, num_labels=2)
    with pytest.raises(rl.ConfigError, match="num_labels=2; a reward model gives one score"):
        rl.Session(small_cfg(f"reward.model.path={two}", "run.tensorboard=false"))
    with pytest.raises(rl.ConfigError, match="is not a local Hugging Face model folder"):
        rl.Session(small_cfg(f"reward.model.path={tmp_path / 'missing'}", "run.tensorboard=false"))


def test_disagreement_counts_pairs_the_rule_tells_apart_that_the_model_orders_the_other_way():
    from rlbench_nb.metrics.compute import model_vs_rule
    batch = Batch({"rm_scores_B": torch.tensor([2.0, 1.0, 0.0, 0.0, 5.0, 5.0, -3.0, 0.5, -1.0]),
                   "rule_scores_B": torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5])},
                  {"group": ["a", "a", "b", "b", "c", "c", "d", "d", "d"]})
    # a: agree. b: a model tie on a pair the rule tells apart, half. c: the rule ties, no pair.
    # d: rule 1 > 0.5 > 0, model -3 < -1 < 0.5: all three pairs the other way. 1 + 1 + 3 = 5 pairs, 3.5 wrong
    m = model_vs_rule(batch)
    assert m["reward/model_disagree"] == pytest.approx(3.5 / 5)
    assert m["reward/model"] == pytest.approx(sum([2, 1, 0, 0, 5, 5, -3, 0.5, -1]) / 9)
    same = Batch({"rm_scores_B": torch.tensor([1.0, 2.0]), "rule_scores_B": torch.tensor([1.0, 1.0])},
                 {"group": ["a", "a"]})
    assert "reward/model_disagree" not in model_vs_rule(same)  # nothing told apart: no share to give


def test_near_misses_are_distinct_wrong_answers_one_edit_away():
    """The reward model's hard negatives: what a policy that almost knows the sum writes (and what it finds
    when it hunts for a reward model's blind spots)."""
    import random

    from rlbench_nb.data.tasks.reward_model import near_misses
    rng = random.Random(0)
    for answer in ("82", "7", "0", "100", "-12"):
        got = near_misses(answer, rng, 1000)
        assert len(got) == len(set(got)) and answer not in got and len(got) >= 15, (answer, got)
        for wrong in got:
            int(wrong)  # a number, without leading zeros
            assert not wrong.lstrip("-").startswith("0") or wrong == "0", (answer, wrong)
            assert abs(len(wrong.lstrip("-")) - len(answer.lstrip("-"))) <= 1, (answer, wrong)
    assert {"81", "83", "72", "92", "28", "8", "2", "182", "832", "86"} <= set(near_misses("82", rng, 1000))
    assert len(near_misses("82", rng, 6)) == 6


@pytest.mark.slow  # ~1 min: a warm start and the reward model's sampling and training, on a small task
def test_the_builtin_reward_model_learns_the_verifiers_ranking_and_ppo_runs_on_it_alone(small_cfg):
    import json

    from rlbench_nb.data.tasks import load_task
    cfg = small_cfg("reward.model.path=task", "reward.rule_weight=0", "algo.advantage=gae", "task.num_train=300")
    rm_dir = load_task(cfg).reward_model_dir
    report = json.loads((rm_dir / "rm.json").read_text())
    assert report["samples"] == 270 * 8 and report["probe_samples"] == 30 * 8  # 10% of the prompts held back
    assert report["near_miss_texts"] == 270 * 7  # each training prompt's right answer and 6 answers one edit off
    # it learned to rank the training prompts' right answers above their wrong ones (0.5 is chance)
    assert report["train_pairwise"] > 0.6, report
    stamp = (rm_dir / "model.safetensors").stat().st_mtime_ns
    with rl.Session(cfg) as sess:  # the cached model, not a second build
        assert (rm_dir / "model.safetensors").stat().st_mtime_ns == stamp
        rows = [sess.step() for _ in range(2)]
    for r in rows:  # the reward is the model's alone; the verifier is still run, logged and compared
        assert r["reward/mean"] == pytest.approx(r["reward/model"], abs=1e-6) and 0 <= r["reward/rule"] <= 1
        assert 0 <= r.get("reward/model_disagree", 0.0) <= 1


def test_the_builtin_reward_model_needs_the_builtin_policy(small_cfg, tmp_path):
    with pytest.raises(rl.ConfigError, match="reward.model.path=task is trained on the built-in warm start's "
                                             "samples, not on model.path="):
        rl.Session(small_cfg("reward.model.path=task", f"model.path={tmp_path}"))
