"""Tools a model calls from inside an episode, and `ToolEnv`, the environment that runs them.

A tool is a plain Python function with type hints and a docstring whose `Args:` section describes each
parameter: the JSON schema shown to the model comes from them (`transformers.utils.get_json_schema`, the same
schema `apply_chat_template(tools=...)` renders). The model calls one by writing it between tags:

    <call>1234+5678</call>                                       one tool with one parameter: the text is its argument
    <call>{"name": "calculator", "arguments": {"expr": "1+2"}}</call>     any tool, JSON arguments

and the environment answers `<result>6912</result>` (or `<result>error: ...</result>`: a tool that raises, hangs
past `tool_timeout_s` or is called wrongly costs the model a turn, never the episode). A turn without a call
is the final answer, scored by `score(row, text)`.
"""
from __future__ import annotations

import ast
import concurrent.futures
import json
import operator
from collections.abc import Callable

from ..errors import UsageError
from .base import Env, ThreadPerCall

_CALLS = ThreadPerCall()  # a hung tool call holds its own thread, not a slot the next calls wait for


class Tool:
    """A function the model may call: its name, its JSON schema (from the signature and docstring), the call."""

    def __init__(self, fn: Callable):
        from transformers.utils import get_json_schema
        self.fn, self.name = fn, getattr(fn, "__name__", type(fn).__name__)
        try:
            self.schema = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException / ValueError
            raise UsageError(f"tool {self.name!r} cannot be described to the model ({e}): give every parameter a "
                             "type hint and the function a docstring whose 'Args:' section has a line for each "
                             "parameter") from None
        params = self.schema["function"]["parameters"]
        self.parameters: list[str] = list(params.get("properties", {}))
        self.required: list[str] = list(params.get("required", []))

    def __call__(self, **arguments):
        return self.fn(**arguments)

    def __repr__(self) -> str:
        return f"Tool({self.name}({', '.join(self.parameters)}))"


class ToolEnv(Env):
    """An episode in which the model may call `tools` before it answers; subclass it and list the functions.

    `score(row, answer_text)` gives the final answer's reward (default: 1.0 when it equals row['answer']).
    Counts of the episode's calls and failed calls are kept on the instance (`calls`, `errors`) for the
    rollout's metrics."""

    tools: list[Callable] = []
    call_tags: tuple[str, str] = ("<call>", "</call>")
    result_tags: tuple[str, str] = ("<result>", "</result>")
    tool_timeout_s: float = 5.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.call_tags[1],)

    def reset(self, row: dict) -> str:
        self.calls, self.errors = 0, 0
        return super().reset(row)

    @property
    def tool_table(self) -> dict[str, Tool]:
        if "_tool_table" not in self.__dict__:
            self._tool_table = {t.name: t for t in map(Tool, self.tools)}
        return self._tool_table

    def score(self, row: dict, answer_text: str) -> float:
        return 1.0 if answer_text.strip() == str(row.get("answer", "")).strip() else 0.0

    def step(self, action_text: str) -> tuple[str | None, float, bool]:
        opened, closed = self.call_tags
        start = action_text.rfind(opened)
        end = action_text.find(closed, start + len(opened)) if start >= 0 else -1
        if start < 0 or end < 0:  # no call: this is the answer
            return None, self.score(self.row, action_text), True
        self.calls = getattr(self, "calls", 0) + 1
        result, failed = self.call(action_text[start + len(opened):end])
        self.errors = getattr(self, "errors", 0) + failed
        left, right = self.result_tags
        return f"{left}{'error: ' if failed else ''}{result}{right}", 0.0, False

    def call(self, text: str) -> tuple[str, bool]:
        """Run the call written as `text` -> (result text, whether it failed)."""
        try:
            tool, arguments = self._parse(text.strip())
        except ValueError as e:
            return str(e), True
        future = _CALLS.submit(tool, **arguments)
        try:
            return str(future.result(timeout=self.tool_timeout_s)), False
        except concurrent.futures.TimeoutError:
            return f"{tool.name} took longer than {self.tool_timeout_s:g} s", True
        except Exception as e:  # noqa: BLE001 — the tool's failure is the model's observation
            return f"{tool.name} raised {type(e).__name__}: {e}", True

    def _parse(self, text: str) -> tuple[Tool, dict]:
        table = self.tool_table
        if text.startswith("{"):
            try:
                call = json.loads(text)
                name, arguments = call["name"], call.get("arguments", {})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"cannot read the call {text[:60]!r}: {e}") from None
            if name not in table:
                raise ValueError(f"no tool {name!r}; tools: {sorted(table)}")
            if not isinstance(arguments, dict):
                raise ValueError(f"arguments of {name} must be an object, got {type(arguments).__name__}")
            tool = table[name]
            unknown = sorted(set(arguments) - set(tool.parameters))
            missing = sorted(set(tool.required) - set(arguments))
            if unknown or missing:
                raise ValueError(f"{name} takes {tool.parameters}" + (f"; unknown {unknown}" if unknown else "")
                                 + (f"; missing {missing}" if missing else ""))
            return tool, arguments
        single = [t for t in table.values() if len(t.parameters) == 1]
        if len(table) == 1 and single:
            return single[0], {single[0].parameters[0]: text}
        raise ValueError(f'write the call as {{"name": ..., "arguments": {{...}}}}; tools: {sorted(table)}')


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expr: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expr: The expression, e.g. "1234+5678" or "12*(3-5)".
    """
    if len(expr) > 64:
        raise ValueError("expression longer than 64 characters")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
            if abs(out) >= 10**18:
                raise ValueError("result too large")
            return out
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"only integers, +, -, * and parentheses: {expr!r}")

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expr!r}") from None
    return str(value(tree.body))
