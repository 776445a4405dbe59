"""The built-in arithmetic task in the schemas the cookbook recipes read (GSM8K rows for rl_loop, chat rows for
sl_loop), and a model that can read them: the chat model of tests/chat_model.py (Qwen2 shape, ChatML) with its
byte-level BPE trained on these very texts. rl_loop's few-shot prefix and answer format are the recipe's own."""
from __future__ import annotations

import random
from pathlib import Path

from .chat_model import make_chat_model

# rl_loop.py's prompt, as published (tinker_cookbook 0.5.8): the question suffix and the one-shot example
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
PREFIX = [{"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
          {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
           "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"}]
MAX_OPERAND = 4  # sums 0..8: one digit, so a model that has the format right guesses 1 in 9 before it adds


def problems(seed: int = 0) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    """rl_loop's dataset: `question`, and `answer` ending in '#### N' (GSM8K's schema)."""
    ps = problems(seed)
    return [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in (ps * (n // len(ps) + 1))[:n]]


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """sl_loop's dataset (no_robots' schema): `messages`, the recipe's one-shot prefix and the answer in its format."""
    return [{"messages": [*PREFIX, {"role": "user", "content": r["question"] + SUFFIX},
                          {"role": "assistant", "content": f"\\boxed{{{r['answer'].split('#### ')[1]}}}"}]}
            for r in gsm8k_rows(n, seed)]


def _chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def make_task_model(path: Path) -> Path:
    """A random Qwen2-shaped chat model whose tokenizer was trained on the task's rendered conversations."""
    corpus = [_chatml(r["messages"]) for r in chat_rows(200)]
    return make_chat_model(path, corpus, vocab_size=400)
