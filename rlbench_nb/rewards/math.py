"""Verifiable math rewards, each a plain `fn(prompt, response, **row) -> float` usable as `reward.fn`:

    reward.fn: rlbench_nb.rewards:gsm8k          # "#### 72" or else the last number, against row["answer"]
    reward.fn: rlbench_nb.rewards:boxed_math     # the last \\boxed{...}, against row["answer"]
    reward.fn: rlbench_nb.rewards:think_format   # <think>...</think> then an answer

`combine` weighs several into one (in a file of your own: `reward.fn: my_rewards.py:reward`).
The ground truth may be the bare answer or a whole reference solution (GSM8K's "... #### 72", MATH's
"... \\boxed{...}"): the answer is taken out of it the same way.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from .answers import NUMBER_RE, boxed_answer, equivalent, hashes_answer, last_number, to_number
from .scored import Scored


def gsm8k(prompt: str, response: str, answer: str, strict: bool = False, **_) -> float:
    """1.0 when the response's final answer equals the row's by value ("1,000" = "1000.0" = "$1000"), else 0.0.
    The final answer is what follows the last `####`; without one, the last number in the response (unless
    `strict`, as verl's strict mode: then no `####` scores 0)."""
    predicted = hashes_answer(response)
    if predicted is None and not strict:
        predicted = last_number(response)
    if predicted is None:
        return 0.0
    truth = hashes_answer(str(answer)) or str(answer)
    given, expected = to_number(predicted), to_number(truth)
    if given is None:
        given = _first_number(predicted)
    return float(given is not None and expected is not None and given == expected)


def _first_number(text: str):
    """`#### 18 dollars and 50 cents`-style lines: their first number is the answer given."""
    found = NUMBER_RE.findall(text)
    return to_number(found[0]) if found else None


def boxed_math(prompt: str, response: str, answer: str, **_) -> float:
    """1.0 when the response's last `\\boxed{...}` is equivalent to the row's answer (answers.equivalent:
    math-verify when installed, else numbers by value and normalised LaTeX), else 0.0; no box scores 0."""
    predicted = boxed_answer(response)
    if predicted is None:
        return 0.0
    truth = boxed_answer(str(answer)) or str(answer)
    return float(equivalent(predicted, truth))


def gsm8k_format(prompt: str, response: str, **_) -> float:
    """1.0 when the response states its final answer as GSM8K asks, `#### <number>` (whatever the number), else
    0.0: the format half of `combine((gsm8k, 1.0), (gsm8k_format, 0.2))`."""
    given = hashes_answer(response)
    return float(given is not None and bool(NUMBER_RE.search(given)))


THINK_RE = re.compile(r"^\s*<think>(?P<thought>.*?)</think>\s*(?P<answer>\S.*)$", re.DOTALL)


def think_format(prompt: str, response: str, **_) -> float:
    """1.0 when the response is `<think>...</think>` with something in it, then a non-empty answer, and no
    second `<think>`; else 0.0. A prompt that already opens `<think>` (a chat template that starts the
    thought) counts as the response's opening tag."""
    text = response if not prompt.rstrip().endswith("<think>") else "<think>" + response
    m = THINK_RE.match(text)
    return float(bool(m and m["thought"].strip() and "<think>" not in m["answer"]))


def combine(*parts: tuple[Callable[..., float], float]) -> Callable[..., float]:
    """One reward from weighted parts: `combine((gsm8k, 1.0), (think_format, 0.2))` scores
    1.0 * gsm8k(...) + 0.2 * think_format(...), as a `Scored` that keeps each part's own score (the metrics
    `reward/part/gsm8k`, `eval/part/think_format`: rewards/scored.py). Each part gets the same arguments; a
    part that raises fails the sample (the reward worker records the error and scores it 0), never silently
    scores 0 itself."""
    if not parts:
        raise ValueError("combine() needs at least one (function, weight) pair")
    for part in parts:
        if not (isinstance(part, tuple) and len(part) == 2 and callable(part[0])
                and isinstance(part[1], (int, float))):
            raise TypeError(f"combine() takes (function, weight) pairs, got {part!r}")
    names = _part_names([fn for fn, _ in parts])

    def combined(prompt: str, response: str, **row) -> Scored:
        scores = {name: fn(prompt, response, **row) for name, (fn, _) in zip(names, parts)}
        return Scored(sum(weight * scores[name] for name, (_, weight) in zip(names, parts)), scores)

    combined.__name__ = "+".join(f"{w:g}*{getattr(f, '__name__', 'reward')}" for f, w in parts)
    # the package's own rewards run in the reward worker's process; a combination holding code of yours is
    # yours, and keeps the isolation yours gets (reward.isolation: auto)
    modules = [getattr(f, "__module__", None) or "__main__" for f, _ in parts]
    yours = [m for m in modules if not m.startswith("rlbench_nb.")]
    combined.__module__ = yours[0] if yours else combined.__module__
    return combined


def _part_names(fns: list[Callable]) -> list[str]:
    """Each function's name; a name used twice gets _2, _3 (two lambdas: <lambda>, <lambda>_2)."""
    names: list[str] = []
    for fn in fns:
        base = getattr(fn, "__name__", type(fn).__name__)
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


# GSM8K's answer by value, plus a little for stating it in the asked format, as a config names it:
# reward.fn: rlbench_nb.rewards:gsm8k_with_format (the format helps only where some answers use it already:
# SmolLM2-135M-Instruct writes `####` in none of 32 samples)
gsm8k_with_format = combine((gsm8k, 1.0), (gsm8k_format, 0.2))
