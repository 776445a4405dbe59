"""A reward that says what it is made of: `combine` returns one, and your own function may too.

    return Scored(1.2, {"gsm8k": 1.0, "gsm8k_format": 1.0})

It is a float: its value is the reward the algorithm sees. The reward worker keeps each sample's `parts`
(`reward_parts` in the batch, the rollout files and the inspector) and the metrics average each part over
the samples that have it: `reward/part/<name>` for a training step, `eval/part/<name>` for an evaluation
(with `combine((gsm8k, 1.0), (gsm8k_format, 0.2))`, `eval/part/gsm8k_format` is the share of held-out
answers in the asked format, beside `eval/accuracy`). Parts are each function's own score, before its weight.
"""
from __future__ import annotations


class Scored(float):
    parts: dict[str, float]

    def __new__(cls, value: float, parts: dict[str, float]):
        self = super().__new__(cls, value)
        self.parts = dict(parts)
        return self

    def __reduce__(self):  # pickles (to and from a reward process) with its parts
        return (Scored, (float(self), self.parts))

    def __repr__(self) -> str:
        return f"Scored({float(self)!r}, {self.parts!r})"
