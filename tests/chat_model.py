"""A random-initialised chat model of a real architecture, built offline: Qwen2 (tied embeddings, grouped-query
attention, rope theta 1e6 — Qwen2.5-0.5B-Instruct's shape, only smaller) with a byte-level BPE tokenizer of the
same class (`Qwen2Tokenizer`), ChatML specials and a ChatML chat template. Recipes run on it in CI through the
real code path (chat template, long prompts, the rewards library) without downloading anything."""
from __future__ import annotations

from pathlib import Path

CHATML = ("{%- if messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
          "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_chat_model(path: Path, corpus: list[str], vocab_size: int = 512, seed: int = 0) -> Path:
    """Write tokenizer + model to `path` (a local Hugging Face directory) and return it."""
    return _write(path, corpus, vocab_size, seed, "Qwen2ForCausalLM")


def make_reward_model(path: Path, corpus: list[str], vocab_size: int = 384, seed: int = 1, num_labels: int = 1) -> Path:
    """The same architecture as a sequence classifier (`Qwen2ForSequenceClassification`, a score head on the
    last non-pad token): a reward model with a tokenizer and chat template of its own."""
    return _write(path, corpus, vocab_size, seed, "Qwen2ForSequenceClassification", num_labels=num_labels)


def _write(path: Path, corpus: list[str], vocab_size: int, seed: int, arch: str, **extra) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Qwen2Tokenizer(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None)
    tok.chat_template = CHATML
    tok.save_pretrained(str(path))
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1e6,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, **extra)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        getattr(transformers, arch)(cfg).save_pretrained(str(path))
    return Path(path)
