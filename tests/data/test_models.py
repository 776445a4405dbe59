"""model.path's bad inputs: each is one line naming the thing and the fix, before anything is written or started.
(A real GGUF converting into a folder is tests/test_real_model.py's, on SmolLM2-135M-Instruct.)"""
from __future__ import annotations

import json

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.config import ConfigError, DataConfig
from rlbench_nb.data.models import model_folder
from rlbench_nb.data.tasks.arithmetic import make_tokenizer
from rlbench_nb.prompts import PromptCodec


def test_a_gguf_transformers_cannot_read_is_refused_and_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBENCH_NB_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.Q4_0.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # the magic, then no valid header
    with pytest.raises(ConfigError, match=r"model.path=.*broken.Q4_0.gguf: transformers .* cannot read this GGUF"):
        model_folder(bad)
    assert not list((tmp_path / "cache").glob("gguf/*"))  # neither a folder nor a half-written one


def test_a_folder_must_be_a_model_with_a_tokenizer_or_hold_one_gguf(tmp_path):
    with pytest.raises(ConfigError, match="neither a folder nor a .gguf file"):
        model_folder(tmp_path / "missing")
    with pytest.raises(ConfigError, match="has no config.json"):
        model_folder(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\): name one of them"):
        model_folder(tmp_path)
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    (weights_only / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="has no tokenizer .*tokenizer.save_pretrained"):
        model_folder(weights_only)
    make_tokenizer(weights_only)
    assert model_folder(weights_only) == weights_only


def test_a_chat_template_that_drops_the_prompt_is_refused(tmp_path):
    tok = make_tokenizer(tmp_path)
    tok.chat_template = "{% for m in messages %}{{ m['text'] }}{% endfor %}"  # written for another message key
    with pytest.raises(ConfigError, match="drops the prompt.*message\\['content'\\].*data.chat_template=false"):
        PromptCodec(tok, DataConfig(chat_template=True))
    PromptCodec(tok, DataConfig(chat_template=False))  # the prompts go as they are: nothing to check
    tok.chat_template = "{{ raise_exception('no') }}"
    with pytest.raises(ConfigError, match="fails on a plain user message"):
        PromptCodec(tok, DataConfig(chat_template=True))
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert PromptCodec(tok, DataConfig(chat_template=True)).prompt_ids("1+2=")


def test_a_tokenizer_without_eos_is_refused(tmp_path):
    tok = make_tokenizer(tmp_path)
    tok.eos_token = None
    with pytest.raises(ConfigError, match="has no EOS token, so no response could end"):
        PromptCodec(tok, DataConfig())


def test_a_session_on_a_broken_model_folder_writes_nothing(small_cfg, tmp_path):
    """The check runs with the task, before the run directory is claimed: a refused model leaves no trace."""
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    with pytest.raises(ConfigError, match="has no tokenizer"):
        rl.Session(small_cfg(f"model.path={model}"))
    assert not (tmp_path / "runs").exists()


def test_a_system_prompt_goes_before_each_prompt_or_is_refused_where_the_template_loses_it(tmp_path):
    """data.system_prompt: a system turn before the user's (SmolLM2's template writes its own default system
    turn only when none is given); without a chat template, its text and a blank line before the prompt."""
    tok = make_tokenizer(tmp_path)
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    codec = PromptCodec(tok, DataConfig(system_prompt="Answer as '#### N'."))
    assert tok.decode(codec.prompt_ids("1+2=")) == tok.decode(tok("[system]Answer as '#### N'.[user]1+2=[assistant]",
                                                                  add_special_tokens=False)["input_ids"])
    plain = PromptCodec(tok, DataConfig(chat_template=False, system_prompt="Be brief."))
    assert plain.prompt_ids("1+2=") == tok("Be brief.\n\n1+2=")["input_ids"]
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
                         "{% endfor %}")  # keeps the user's turn only
    PromptCodec(tok, DataConfig())  # fine without a system prompt
    with pytest.raises(ConfigError, match=r"drops the system message \(data.system_prompt\)"):
        PromptCodec(tok, DataConfig(system_prompt="Answer as '#### N'."))
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")  # as Gemma's
    with pytest.raises(ConfigError, match=r"fails on a system message \(data.system_prompt\).*not supported"):
        PromptCodec(tok, DataConfig(system_prompt="x"))


def test_encode_left_pads_each_prompt_and_tokenises_it_once_per_settings(tmp_path, monkeypatch):
    """PromptCodec.encode: each row's ids left-padded to the longest, repeated n times in place, the mask 1 on the
    prompt, the row's fields beside. A prompt is tokenised once (the dataset check counts every prompt: a step's
    prompts then cost no tokenizer call), again when a setting it depends on changed in the session, and every
    time past the memo's size (`memo_tokens`; 0 in a rollout worker, whose observations rarely repeat)."""
    tok = make_tokenizer(tmp_path)
    calls = []
    real_call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__",
                        lambda self, text, **kw: calls.append(text) or real_call(self, text, **kw))
    data = DataConfig(chat_template=False)
    codec = PromptCodec(tok, data)
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "12+30=", "answer": "42"}]
    expect = [real_call(tok, r["prompt"])["input_ids"] for r in rows]
    width, pad = max(map(len, expect)), tok.pad_token_id
    assert len(expect[0]) < width  # one row is padded
    for tag in ("s0", "s1"):
        b = codec.encode(rows, 2, tag)
        assert b["prompt_ids_BP"].tolist() == [[pad] * (width - len(x)) + x for x in expect for _ in range(2)]
        assert b["prompt_mask_BP"].tolist() == [[0] * (width - len(x)) + [1] * len(x) for x in expect for _ in range(2)]
        assert b["prompt_ids_BP"].dtype == b["prompt_mask_BP"].dtype == torch.long
        assert b["group"] == [f"{tag}-0", f"{tag}-0", f"{tag}-1", f"{tag}-1"] and b["answer"] == ["3", "3", "42", "42"]
    assert calls == ["1+2=", "12+30="]  # once each, for two draws
    data.system_prompt = "Be brief."  # sess.configure can change it: the old ids are not the prompt any more
    assert codec.prompt_ids("1+2=") == real_call(tok, "Be brief.\n\n1+2=")["input_ids"]
    data.chat_template, tok.chat_template = True, "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert codec.prompt_ids("1+2=") == real_call(tok, "<Be brief.><1+2=>", add_special_tokens=False)["input_ids"]
    tok.chat_template = "{% for m in messages %}{{ m['content'] }};{% endfor %}"  # a template fixed in the session
    assert codec.prompt_ids("1+2=") == real_call(tok, "Be brief.;1+2=;", add_special_tokens=False)["input_ids"]
    fresh = PromptCodec(tok, data, memo_tokens=0)
    calls.clear()
    fresh.encode(rows, 2, "s0"), fresh.encode(rows, 2, "s1")
    assert len(calls) == 4  # nothing kept: tokenised each time, the same ids
    assert fresh.prompt_ids("1+2=") == codec.prompt_ids("1+2=")


def test_decode_keeps_only_the_masked_response_tokens_and_drops_special_ones(tmp_path):
    """PromptCodec.decode: one text per row from the tokens its mask keeps (a masked-out token in the middle
    or after EOS is not text), special tokens (EOS, pad) dropped, the lengths in tokens beside."""
    import torch

    from rlbench_nb.data.batch import Batch
    tok = make_tokenizer(tmp_path, words=("calc",))
    codec = PromptCodec(tok, DataConfig())
    rows = ["12+3", "calc 7", "", "9"]
    ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    width = max(map(len, ids)) + 2
    response = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    response[0, 1] = tok("5", add_special_tokens=False)["input_ids"][0]  # "15+3" ...
    mask[0, 1] = 0  # ... but the '5' is masked out: "1+3"
    response[3, 2] = tok("8", add_special_tokens=False)["input_ids"][0]  # after EOS, unmasked: not text
    out = codec.decode(Batch({"response_ids_BR": response, "response_mask_BR": mask}))
    assert out["response"] == ["1+3", "calc 7", "", "9"]
    assert out["response_len_B"].tolist() == [4, 4, 1, 2]  # the kept tokens, EOS included


def test_batch_decode_gives_transformers_own_text_and_skips_its_walk_only_where_that_is_the_same(tmp_path):
    """prompts.batch_decode: a fast tokenizer that cleans nothing up goes straight to its backend; the text is
    transformers' batch_decode for every row (special tokens, unknown words, empty rows). One that cleans up
    spaces, or decodes its own way, goes through transformers."""
    import random

    from rlbench_nb import prompts
    tok = make_tokenizer(tmp_path, words=("calc",))
    rng = random.Random(0)
    rows = [[rng.randrange(len(tok)) for _ in range(rng.randrange(12))] for _ in range(50)] + [[], [tok.eos_token_id]]
    assert not tok.clean_up_tokenization_spaces and prompts._decodes_as_its_backend(type(tok))
    backend_calls = []
    real = tok.backend_tokenizer.decode_batch
    tok.backend_tokenizer.decode_batch = lambda *a, **k: backend_calls.append(1) or real(*a, **k)
    assert prompts.batch_decode(tok, rows) == tok.batch_decode(rows, skip_special_tokens=True)
    assert backend_calls == [1]
    tok.clean_up_tokenization_spaces = True  # transformers decides what that means for this tokenizer
    assert prompts.batch_decode(tok, rows) == tok.batch_decode(rows, skip_special_tokens=True)
    assert backend_calls == [1]

    class OwnDecode(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return "x" * len(token_ids)
    assert not prompts._decodes_as_its_backend(OwnDecode)
