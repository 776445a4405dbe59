"""Reward functions for real workloads: verifiable math answers (GSM8K, boxed LaTeX), a thinking format,
and weighted combinations. Each is a plain `fn(prompt, response, **row) -> float` (see `rewards/math.py`).

    reward.fn: rlbench_nb.rewards:gsm8k
"""
from .answers import boxed_answer, equivalent, hashes_answer, last_number, to_number
from .math import boxed_math, combine, gsm8k, gsm8k_format, gsm8k_with_format, think_format
from .scored import Scored

__all__ = ["Scored", "boxed_answer", "boxed_math", "combine", "equivalent", "gsm8k", "gsm8k_format",
           "gsm8k_with_format", "hashes_answer", "last_number", "think_format", "to_number"]
