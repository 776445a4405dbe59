"""A real instruct model on real GSM8K (SmolLM2-135M-Instruct from its GGUF, tests/real_assets.py), fp32 on a
CPU: what a toy never exercises — a 49k vocabulary, a real chat template whose end-of-turn token is both EOS and
pad, responses of hundreds of tokens with real length spread, log-probs far from uniform.

Tolerances. The engine decodes one token at a time against a KV cache; a teacher-forced forward reads the whole
sequence at once: the same math with fp32 sums blocked differently (and left padding moves them again), through
30 layers. Measured on a 2-core Intel Xeon (AVX-512): sampled vs teacher-forced log-probs differ by 8.6e-6 on
average and 4.0e-5 at most over ~2,100 tokens; logits move by ~1e-5. The bounds below leave 3x (mean) and 10x
(max) room for another CPU's kernels and stay orders of magnitude below what a real fault does (a shifted
position or stale weights: errors of 0.1-10). Greedy text is compared exactly, except after a position where the
two best tokens tie within 1e-4 — 10x the rounding noise, where either choice is the right argmax on some CPU.
"""
from __future__ import annotations

import json

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.rewards import gsm8k

from .conftest import assert_rollout_holds_policy_weights
from .roles.test_precision import _assert_grads_close

# every test here needs the real assets; the GGUF load and the notebook also run in the default stage (CI): the
# fixture fetches and converts the assets from nothing there (~1 min), and the two take ~2.5 min more
pytestmark = [pytest.mark.real, pytest.mark.integration]

TIE = 1e-4          # a top-2 logit gap below this is a tie (see above)
EVAL_ROWS, EVAL_TOKENS = 16, 128
SAMPLE_TOKENS = 300


def _cfg(assets, tmp_path, *overrides):
    return rl.Config.load("configs/gsm8k_grpo.yaml", [
        f"model.path={assets.model}", f"data.train_path={assets.gsm8k / 'train.jsonl'}",
        # fp32 engine too (rollout.dtype=auto would be bf16 on an AVX512-BF16 CPU): these tests pin fp32 exactness
        f"data.test_path={assets.gsm8k / 'test.jsonl'}", "model.dtype=float32", "rollout.dtype=model",
        f"run.dir={tmp_path / 'runs'}",
        "run.tensorboard=false", "data.batch_size=2", "rollout.n=4", "algo.kl_coef=0", *overrides])


@pytest.fixture(scope="module")
def real_session(real_assets, tmp_path_factory):
    sess = rl.Session(_cfg(real_assets, tmp_path_factory.mktemp("real"), f"rollout.max_new_tokens={SAMPLE_TOKENS}",
                           "rollout.micro_batch_size=8"))
    yield sess
    sess.close()


@pytest.fixture(scope="module")
def sampled(real_session):
    """One sampled, scored, prepared batch of 2 GSM8K questions x 4 samples (up to 300 new tokens)."""
    return real_session.prepare(real_session.score(real_session.rollout()))


@pytest.mark.slow
def test_the_doctor_passes_on_the_real_model(real_session):
    """sess.doctor() on the real model in fp32: every check passes, each measured (none skipped but the KL to a
    reference and the LoRA adapter, which this session does not have), and the session's step and data position
    are as they were."""
    state = real_session.controller_state()
    report = real_session.doctor(rows=2)
    assert report.ok, str(report)
    skipped = [c.name for c in report.checks if c.ok is None]
    assert skipped == ["the LoRA adapter reaches the engine", "KL to the reference at step 0"], str(report)
    assert real_session.controller_state() == state


def _alone_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits predicting each response token, from one unpadded sequence alone (batch of one)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) + len(response) - 1]


def _gap(logits_V: torch.Tensor) -> float:
    top = logits_V.topk(2).values
    return float(top[0] - top[1])


# Cost ~25 s: dequantizes the real 98 MB GGUF; the only check that the published file loads as the README says.
def test_the_gguf_file_itself_loads_as_its_converted_folder(real_assets, monkeypatch):
    """model.path may name the .gguf file (or its folder): converted once through transformers' GGUF reader into a
    cached from_pretrained folder (the fixture's, built by the same function) with the GGUF's own logits, its
    tokenizer and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbench_nb.data.models import SOURCE_FILE, model_folder
    monkeypatch.setenv("RLBENCH_NB_CACHE", str(real_assets.model.parent.parent))
    assert model_folder(real_assets.gguf) == real_assets.model  # found in the cache: not converted again
    assert model_folder(real_assets.gguf.parent) == real_assets.model  # a folder holding one .gguf, no config.json
    assert json.loads((real_assets.model / SOURCE_FILE).read_text())["parameters"] == 134_515_008
    ours = AutoModelForCausalLM.from_pretrained(real_assets.model, dtype=torch.float32).eval()
    direct = AutoModelForCausalLM.from_pretrained(real_assets.gguf.parent, gguf_file=real_assets.gguf.name,
                                                  dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(real_assets.model)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tok.chat_template
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, direct(input_ids=ids).logits)
        assert "Paris" in tok.decode(ours.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:])


def test_the_real_tokenizer_decodes_a_steps_rows_in_one_backend_call_with_transformers_own_text(real_assets):
    """prompts.batch_decode takes its one-call path on SmolLM2's byte-level BPE tokenizer (what a real run decodes
    with) and gives exactly transformers' batch_decode: random ids (partial UTF-8 sequences, special tokens),
    GSM8K answers, empty rows."""
    import random

    from transformers import AutoTokenizer

    from rlbench_nb import prompts
    tok = AutoTokenizer.from_pretrained(real_assets.model)
    assert prompts._decodes_as_its_backend(type(tok)) and not tok.clean_up_tokenization_spaces
    rng = random.Random(0)
    rows = [[rng.randrange(len(tok)) for _ in range(rng.randrange(40))] for _ in range(200)] + [[]]
    answers = [json.loads(line)["answer"] for line in (real_assets.gsm8k / "test.jsonl").read_text().splitlines()[:50]]
    rows += [tok(a)["input_ids"] + [tok.eos_token_id] for a in answers]
    assert prompts.batch_decode(tok, rows) == tok.batch_decode(rows, skip_special_tokens=True)


@pytest.mark.slow
def test_greedy_evaluation_gives_plain_generates_answers(real_session, real_assets):
    """sess.evaluate() on 16 GSM8K test questions: the same response text per question as transformers'
    generate() on the same chat-templated prompts (batched, left-padded by HF), and every token the argmax of the
    prompt + response read alone, unpadded: our left padding and micro-batches (8 + 8) change no greedy answer."""
    from transformers import AutoModelForCausalLM
    sess = real_session
    rows = [json.loads(line) for line in (real_assets.gsm8k / "test.jsonl").read_text().splitlines()[:EVAL_ROWS]]
    result = sess.evaluate(rows, max_new_tokens=EVAL_TOKENS)
    saved = [json.loads(line) for line in (sess.run_dir / "rollouts" / "eval_step_000000.jsonl").open()]
    assert [r["prompt"] for r in saved] == [r["prompt"] for r in rows]

    tok = sess.prompts.tokenizer
    model = AutoModelForCausalLM.from_pretrained(real_assets.model, dtype=torch.float32).eval()
    prompts = [sess.prompts.prompt_ids(r["prompt"]) for r in rows]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=EVAL_TOKENS, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ties = 0
    for i, (prompt, ours) in enumerate(zip(prompts, saved)):
        response = ours["tokens"]["response"]
        theirs = out[i, width:].tolist()
        theirs = theirs[:theirs.index(tok.eos_token_id) + 1] if tok.eos_token_id in theirs else theirs
        logits = _alone_logits(model, prompt, response)
        for t, token in enumerate(response):  # the argmax of the unpadded sequence, or a tie
            if token != int(logits[t].argmax()):
                assert _gap(logits[t]) < TIE, (i, t, _gap(logits[t]))
                ties += 1
                break
        if response != theirs:
            first = next(t for t, (a, b) in enumerate(zip(response + [-1], theirs + [-1])) if a != b)
            assert first < len(response) and _gap(logits[first]) < TIE, (i, first, ours["response"][-80:])
            ties += 1
        else:
            assert ours["response"] == tok.decode(theirs, skip_special_tokens=True)
    assert ties <= 2  # a tie is rare (~1e-5 noise against top-2 gaps of a peaked distribution)
    lengths = [len(r["tokens"]["response"]) for r in saved]
    assert max(lengths) == EVAL_TOKENS and min(lengths) < EVAL_TOKENS  # capped and EOS-ended answers both
    accuracy = sum(gsm8k(r["prompt"], tok.decode(o, skip_special_tokens=True), answer=r["answer"]) >= 1.0
                   for r, o in zip(rows, (s["tokens"]["response"] for s in saved))) / len(rows)
    assert result["eval/accuracy"] == accuracy and result["eval/n"] == EVAL_ROWS


@pytest.mark.slow
def test_sampled_logprobs_equal_a_teacher_forced_forward(sampled):
    """The engine's log-probs of the tokens it sampled (temperature 1, hundreds of tokens, EOS inside the batch,
    right padding) against the trainer's teacher-forced forward of the same tokens, both fp32."""
    m = sampled["response_mask_BR"].bool()
    lengths = m.sum(1)
    assert lengths.max() == SAMPLE_TOKENS and lengths.min() < SAMPLE_TOKENS and lengths.float().mean() > 100
    ours, trainer = sampled["rollout_logprobs_BR"], sampled["old_logprobs_BR"]
    assert torch.isfinite(ours[m]).all() and (ours[m] <= 0).all() and (ours[~m] == 0).all()
    assert ours[m].mean() < -0.1  # far from a one-hot: a real distribution over a 49k vocabulary
    diff = (ours - trainer)[m].abs()
    assert diff.mean() < 2.5e-5 and diff.max() < 4e-4, (diff.mean().item(), diff.max().item())


@pytest.mark.slow
def test_packed_and_padded_micro_batches_give_the_same_loss_and_gradients(real_session, sampled):
    """Four real responses of different lengths (one ended by EOS): log-probs, entropies and every parameter's
    gradient of packed rows equal the padded forward's."""
    policy = real_session.groups["policy"].workers[0]
    lengths = sampled["response_mask_BR"].sum(1)
    order = lengths.argsort().tolist()
    pick = sorted({order[0], order[1], order[-2], order[-1]})
    batch = sampled.select(pick)
    mask = batch["response_mask_BR"].bool()
    assert len(set(mask.sum(1).tolist())) >= 2
    share, pack = policy.scorer.share_prefix, policy.scorer.pack
    policy.scorer.share_prefix = False
    out = {}
    try:
        for packed in (False, True):
            policy.scorer.pack = packed
            policy.model.zero_grad()
            lp, ent = policy._forward(batch, with_entropy=True)
            ((lp * mask).sum() / mask.sum() + 0.1 * (ent * mask).sum() / mask.sum()).backward()
            out[packed] = lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    finally:
        policy.scorer.share_prefix, policy.scorer.pack = share, pack
        policy.model.zero_grad()
    torch.testing.assert_close(out[True][0][mask], out[False][0][mask], rtol=0, atol=4e-4)
    assert (out[True][0][mask] - out[False][0][mask]).abs().mean() < 2.5e-5
    torch.testing.assert_close(out[True][1][mask], out[False][1][mask], rtol=0, atol=4e-4)
    _assert_grads_close(out[True][2], out[False][2])


def _longer_is_better(prompt, response, **_):
    """A reward that varies within every group (a 135M model solves no GSM8K question: gsm8k's reward is 0 for
    all samples, and so is every advantage): enough to move the adapters in one step."""
    return min(len(response), 400) / 400


@pytest.mark.slow
def test_lora_trains_only_adapters_and_its_merged_weights_reach_the_engine_and_the_exported_folder(
        real_assets, tmp_path):
    """LoRA on the real model: one step moves the adapters alone; the verified push gives the engine the merged
    weights; checkpoint -> `rlbench-nb weights` -> from_pretrained gives the engine's logits."""
    from transformers import AutoModelForCausalLM

    from rlbench_nb.cli import main
    from rlbench_nb.roles import lora as lora_util
    sess = rl.Session(_cfg(real_assets, tmp_path, "model.lora.r=8", "model.lora.alpha=16", "train.lr=2e-3",
                           "data.batch_size=1", "rollout.max_new_tokens=64"))
    sess.set_reward(_longer_is_better)
    policy = sess.groups["policy"].workers[0]
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trained and all(lora_util.is_adapter(n) for n in trained)
    row = sess.step()
    assert row["update/skipped"] == 0 and row["sync/verified"] == 1.0
    after = policy.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(lora_util.is_adapter(k) for k in moved)
    assert_rollout_holds_policy_weights(sess)

    path = sess.save("one")
    assert main(["weights", str(path), "-o", str(tmp_path / "merged")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    engine = sess.groups["rollout"].workers[0].model
    held = exported.state_dict()
    assert held.keys() == engine.state_dict().keys()
    assert all(torch.equal(held[k], v) for k, v in engine.state_dict().items())  # bit for bit
    # the logits: transformers' SDPA here, the engine's small-call attention (ops/attention.py) there — the same
    # math in another order, ~1e-4 apart on logits of ~20; the adapters' one step moves them far more
    ids = torch.tensor([sess.prompts.prompt_ids("What is 12 + 30? Answer after ####.")])
    base = AutoModelForCausalLM.from_pretrained(real_assets.model, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs, before = engine(input_ids=ids).logits, exported(input_ids=ids).logits, base(input_ids=ids).logits
    assert (theirs - ours).abs().max() < 1e-3
    assert (before - ours).abs().max() > 1e-2, (before - ours).abs().max()
    sess.close()


# Cost ~105 s: a kernel loads the 135M model and samples 8 GSM8K answers; the only run of notebook 06 as a user runs it.
def test_the_real_model_notebook_runs_top_to_bottom(real_assets, tmp_path):
    """notebooks/06_real_model.ipynb top to bottom in a real kernel on SmolLM2 and GSM8K: its printed facts are
    the real model's, and the shaped reward re-scores the same 8 samples within its range."""
    import re

    from .test_notebooks import execute
    text = execute("06_real_model.ipynb", f"model = {str(real_assets.model)!r}\ndata = {str(real_assets.gsm8k)!r}\n"
                                          f"steps = 2\nnew_tokens = 64\nrun_dir = {str(tmp_path)!r}\n")
    assert "TokenizersBackend: 49152 tokens, EOS '<|im_end|>' = pad '<|im_end|>'" in text
    assert "7472 training and 1319 test questions" in text
    assert re.search(r"8 responses, \d+-64 tokens", text)
    assert "joined text equals the response: True" in text
    m = re.search(r"groups with a learning signal: ([\d.]+) -> ([\d.]+); shaped rewards \[([^\]]*)\]", text)
    before, after = float(m.group(1)), float(m.group(2))
    shaped = [float(x) for x in m.group(3).split(",")]
    assert len(shaped) == 8 and all(0.0 <= x <= 1.5 for x in shaped)  # 1 + 0.3 + 0.2 at most
    assert before <= after  # the exact reward rarely varies on a 135M model; the shaped one adds credit
    assert len(re.findall(r"step \d: reward [\d.]+, response \d+ tokens, push verified True", text)) == 2
    assert re.search(r"greedy accuracy on 8 held-out questions: [\d.]+; answers in eval_step_000002.jsonl", text)
    # the notebook's defaults sample in bf16 on a CPU with native bf16 (rollout.dtype=auto), fp32 elsewhere: either
    # way the engine stays under the mismatch alarm (2.7e-2 measured in bf16, ~1e-5 in fp32)
    import json
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    mismatch = [r["mismatch/logp_abs_mean"] for r in rows if "mismatch/logp_abs_mean" in r]
    assert len(mismatch) == 2 and max(mismatch) < 0.05, mismatch
