"""The built-in offline task: integer arithmetic with a verifier.

Everything the demo, notebooks and tests need is made here, with no download: a character-level
tokenizer (built with `tokenizers`, saved and loaded through `AutoTokenizer`), a small Llama-style
model from a `transformers` config, a deterministic train/test split of prompts such as "37+45=",
and a verifier that gives 1.0 for the exact answer. RL from a random init cannot learn arithmetic,
so `warm_start.py` supervises the model briefly first, like an instruct model before RL.
"""
from __future__ import annotations

import random
from pathlib import Path

from ...config import ConfigError, ModelConfig, TaskConfig

CHARS = "0123456789+-*= "
SPECIALS = ["<pad>", "<eos>", "<unk>"]
# The split does not depend on run.seed: every run, with any seed, is evaluated on the same held-out prompts.
_SPLIT_SEED = 1234
_LISTED = 1_000_000  # problem spaces up to this size are listed and shuffled; bigger ones are drawn


def make_tokenizer(path: str | Path, words: tuple[str, ...] = ()):
    """Build the character tokenizer and save it to `path`; returns it loaded through AutoTokenizer. `words`:
    strings that are single (non-special) tokens besides the characters — matched before the text is split into
    characters, and kept by `decode(..., skip_special_tokens=True)`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")
    fast.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def make_model(cfg: ModelConfig, vocab_size: int, seed: int):
    """A small Llama from a config (random init, seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    mcfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(mcfg)


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_split(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    """(train_rows, test_rows), each row {"prompt": "37+45=", "answer": "82"}; disjoint and deterministic."""
    need, size = cfg.num_train + cfg.num_test, len(cfg.ops) * (cfg.max_operand + 1) ** 2
    if need > size:
        raise ConfigError(f"task.num_train + task.num_test = {need} but only {size} distinct problems exist "
                         f"with task.max_operand={cfg.max_operand}, task.ops='{cfg.ops}': lower them")
    rng = random.Random(_SPLIT_SEED)
    if size <= _LISTED:
        operands = range(cfg.max_operand + 1)
        problems = [(a, op, b) for op in cfg.ops for a in operands for b in operands]
        rng.shuffle(problems)
    else:  # e.g. 4-digit operands: 10^8 problems, drawn rather than listed
        drawn: dict[tuple, None] = {}
        while len(drawn) < need:
            drawn[(rng.randint(0, cfg.max_operand), rng.choice(cfg.ops), rng.randint(0, cfg.max_operand))] = None
        problems = list(drawn)
    rows = [{"prompt": f"{a}{op}{b}=", "answer": str(_answer(a, op, b))} for a, op, b in problems[:need]]
    return rows[: cfg.num_train], rows[cfg.num_train:]


def verify(prompt: str, response: str, answer: str, **_) -> float:
    """1.0 when the response (up to EOS, spaces ignored) is exactly the answer, else 0.0."""
    return 1.0 if response.strip() == str(answer).strip() else 0.0
