"""mkdocs hook (mkdocs.yml `hooks:`): the configuration page's field tables, generated from rlbench_nb/config.py
at build time, so the page cannot go stale.

docs/config.md holds the marker `<!-- config-fields -->`; every section of `rlbench_nb.config._SECTIONS` becomes
a heading with the section's description and a table of its dotted keys (nested sections such as model.lora
walked), each with its type or allowed values and bounds, its default as the YAML of a saved config shows it,
and its description.
"""
from __future__ import annotations

import json
import re
import types
import typing

MARKER = "<!-- config-fields -->"

_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥"}


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, config_tables())


def config_tables() -> str:
    from rlbench_nb.config import _SECTIONS, Config, _leaves

    defaults = Config().to_dict()  # JSON mode: what a saved config.yaml holds
    out = []
    for section, cls in _SECTIONS.items():
        out += [f"## {section}", "", _text(Config.model_fields[section].description or ""), "",
                "| key | default | type | description |", "|---|---|---|---|"]
        for key, field in _leaves(cls, section):
            value = defaults
            for part in key.split("."):
                value = value[part]
            out.append(f"| `{key}` | `{json.dumps(value)}` | {_type(field)} | {_text(field.description or '')} |")
        out.append("")
    return "\n".join(out)


def _type(field) -> str:
    """The annotation in a reader's words: `int ≥ 0`, `float ≥ 0, < 1`, `hf | vllm`, `float > 0 | null`."""
    t = field.annotation
    kinds = list(typing.get_args(t)) if typing.get_origin(t) in (typing.Union, types.UnionType) else [t]
    optional = type(None) in kinds
    bounds = [f"{sign} {getattr(m, name)}" for m in field.metadata for name, sign in _BOUNDS.items()
              if getattr(m, name, None) is not None]
    words = " | ".join(_annotation(k) for k in kinds if k is not type(None))
    words += (" " + ", ".join(bounds) if bounds else "") + (" | null" if optional else "")
    return _cell(words)


def _annotation(t) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_annotation(a) for a in args)
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(_annotation(a) for a in args)}]"
    if t is type(None):
        return "null"
    return getattr(t, "__name__", str(t))


def _cell(text: str) -> str:
    """Plain text safe in a table cell: no pipes, no angle brackets taken for HTML, no emphasis."""
    return re.sub(r"([|*_<>\[\]])", lambda m: {"<": "&lt;", ">": "&gt;"}.get(m[1], "\\" + m[1]), text)


def _text(text: str) -> str:
    """A description as one table-safe line; `code spans` are kept as they are."""
    text = re.sub(r"(?<=\w)-\n\s*", "-", text)  # a word broken over two source lines: rlbench-nb, log-probs
    parts = " ".join(text.split()).split("`")
    return "`".join(p if i % 2 else _cell(p) for i, p in enumerate(parts))
