"""The built-in tool task: 4-digit addition, which the tiny model cannot do in its head but can with a calculator.

The prompts are the arithmetic task's ("4821+3907="), with operands up to `task.max_operand` (9999 in
configs/arith_tool_grpo.yaml). An episode may answer directly, or call the calculator first:

    4821+3907=<call>4821+3907</call><result>8728</result>8728<eos>
              ^ model ----------^ ^ environment -------^ ^ model

`<call>`, `</call>`, `<result>`, `</result>` are single tokens of the character tokenizer
(`arithmetic.make_tokenizer(path, TAGS)`). The warm start (warm_start.py) supervises whole episodes — the
environment's tokens carry no loss, as in RL — where a share `task.tool_share` of the examples call the tool:
the model learns the format and to copy, and samples a call about that often. Its direct answers are nearly
always wrong, so held-out accuracy starts at about the share of prompts on which greedy decoding happens to
call (~0.46); RL has to find that calling pays. `CalculatorEnv` is the episode's environment
(`env.fn: rlbench_nb.data.tasks.tool_arith:CalculatorEnv`).
"""
from __future__ import annotations

import random

from ...envs import ToolEnv, calculator

CALL, END_CALL, RESULT, END_RESULT = "<call>", "</call>", "<result>", "</result>"
TAGS = [CALL, END_CALL, RESULT, END_RESULT]


class CalculatorEnv(ToolEnv):
    """The model may call `calculator` (one argument: the text between the tags) before it answers; the
    answer scores 1.0 when it is exactly the row's answer."""

    tools = [calculator]
    max_turns = 3


def tool_turns(row: dict) -> list[tuple[str, bool]]:
    """The episode that calls the calculator, as (text, the model wrote it) turns."""
    expr = row["prompt"].rstrip("=")
    return [(f"{CALL}{expr}{END_CALL}", True), (f"{RESULT}{calculator(expr)}{END_RESULT}", False),
            (row["answer"], True)]


def sft_rows(rows: list[dict], tool_share: float, seed: int) -> list[dict]:
    """Warm-start examples: each training row as an episode, a seeded `tool_share` of them calling the tool, and
    once more from an opened call on (`probe_rows`: no loss on the choice to call). The second kind teaches the
    call and the copying of its result twice as fast without making calls likelier than `tool_share`."""
    rng = random.Random(seed)
    episodes = [{"prompt": r["prompt"], "turns": tool_turns(r) if rng.random() < tool_share else [(r["answer"], True)]}
                for r in rows]
    return episodes + probe_rows(rows)


def probe_rows(rows: list[dict]) -> list[dict]:
    """What the warm start's stopping rule measures: given that the model opened a call, does it write the call
    and, after the result, the answer. (Whether to call is the choice RL makes; it is not measured.)"""
    out = []
    for r in rows:
        (call, _), *rest = tool_turns(r)
        out.append({"prompt": r["prompt"] + CALL, "turns": [(call[len(CALL):], True), *rest]})
    return out
