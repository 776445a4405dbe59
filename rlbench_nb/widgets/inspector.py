"""`sess.inspect(batch)` / `rl.inspect(batch_or_rollouts_file)`: find the samples worth looking at.

A table of samples (prompt, response, reward, advantage, length, reward error) that sorts and filters
(`reward == 0`, `length > 3`, `response contains 7`), and a token view of one response coloured by
log-prob, KL to the reference, or advantage. A multi-turn episode (a batch with `loss_mask_BR`) shows turn by
turn: the model's turns coloured, the environment's (tool results) as plain grey text, and the episode's reward,
turns and tool calls below. Rollout content is only ever shown as escaped text, never executed or rendered as
HTML.
"""
from __future__ import annotations

import html
import json
import operator
from itertools import groupby
from pathlib import Path

from ..errors import UsageError

OPS = {"==": operator.eq, "!=": operator.ne, ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
       "contains": lambda a, b: str(b) in str(a)}
COLUMNS = ("prompt", "response", "reward", "reward_before", "advantage", "length", "reward_error")
EPISODE_COLUMNS = ("turns", "tool_calls")  # shown only when some sample has them (multi-turn episodes)
TOKEN_FIELDS = {"log-prob": "old_logprobs_BR", "KL to reference": None, "advantage": "advantages_BR",
                "Δ log p trainer − engine": None}


def _table_row(i: int, shown: dict) -> dict:
    """One inspector row from a sample keyed by the names people see (`Batch.rows()`, rollout files; their
    token ids stay out of the table). `reward_before`: a re-scored batch's earlier reward, beside the new.
    A reward's parts (`combine`'s, rewards/scored.py) are columns of their own, to sort and filter by
    (`gsm8k_format == 0`: the answers not in the asked format)."""
    parts = {k: v for k, v in (shown.get("reward_parts") or {}).items() if k not in _KNOWN}  # never over a column
    return {"index": i, **{c: shown.get(c, "" if c in ("prompt", "response") else None)
                           for c in COLUMNS + EPISODE_COLUMNS}, **parts}


_KNOWN = frozenset(("index",) + COLUMNS + EPISODE_COLUMNS)


def _part_columns(rows: list[dict]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for r in rows for k in r if k not in _KNOWN))


def _rows_from_batch(batch) -> list[dict]:
    return [_table_row(i, r) for i, r in enumerate(batch.rows())]


def _rows_from_file(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        r = json.loads(line)  # data, not code: JSON only
        rows.append(_table_row(i, r))
    return rows


def _coerce(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


class Inspector:
    def __init__(self, source, tokenizer=None, page_size: int = 50):
        from ..data.batch import Batch
        self.batch = source if isinstance(source, Batch) else None
        self.tokenizer = tokenizer
        self.rows = _rows_from_batch(source) if self.batch is not None else _rows_from_file(Path(source))
        if self.batch is None and tokenizer is not None:  # a saved file's token ids: token and turn views
            from ..errors import RLBenchError
            from ..rundir import load_rollouts
            try:
                self.batch = load_rollouts(source, tokenizer.pad_token_id)
            except RLBenchError:
                pass  # a file written before rollout files kept token ids: the table alone
        parts = _part_columns(self.rows)
        for r in self.rows:  # a sample whose reward failed has no parts: None, as a missing reward
            r.update({c: r.get(c) for c in parts})
        self.columns = (COLUMNS + parts
                        + tuple(c for c in EPISODE_COLUMNS if any(r[c] is not None for r in self.rows)))
        self.page_size = page_size
        self.filters: list[tuple[str, str, object]] = []
        self.sort_key, self.descending = "index", False
        self._widget = None

    # ---- the model (testable without a browser) --------------------------------------------------
    def add_filter(self, column: str, op: str, value) -> Inspector:
        if column not in self.columns + ("index",):
            raise UsageError(f"unknown column '{column}'; use one of {self.columns}")
        if op not in OPS:
            raise UsageError(f"unknown operator '{op}'; use one of {list(OPS)}")
        self.filters.append((column, op, _coerce(value) if isinstance(value, str) and op != "contains" else value))
        return self._changed()

    def clear_filters(self) -> Inspector:
        self.filters = []
        return self._changed()

    def sort(self, column: str, descending: bool = False) -> Inspector:
        self.sort_key, self.descending = column, descending
        return self._changed()

    def view(self) -> list[dict]:
        """The rows after filters and sorting."""
        out = []
        for r in self.rows:
            try:
                if all(r[c] is not None and OPS[op](r[c], v) for c, op, v in self.filters):
                    out.append(r)
            except TypeError:
                continue  # e.g. comparing text with a number: not a match
        key = self.sort_key
        return sorted(out, key=lambda r: (r[key] is None, r[key] if r[key] is not None else 0), reverse=self.descending)

    def token_colors(self, index: int, quantity: str = "log-prob") -> list[tuple[str, float]]:
        """(token text, value) for the response of sample `index`, value from `quantity`."""
        if self.batch is None or self.tokenizer is None:
            raise UsageError("token views need a batch, or a rollouts file with token ids, and a tokenizer")
        b = self.batch
        mask = b["response_mask_BR"][index].bool()
        ids = b["response_ids_BR"][index][mask].tolist()
        if quantity == "KL to reference":
            if "ref_logprobs_BR" not in b:
                raise UsageError("this batch has no reference log-probs (algo.kl_coef is 0)")
            # reused old log-probs (algo.reuse_logprobs): the engine's stand in, equal to the trainer's up to the
            # mismatch (mismatch/*: ~1e-6 for the HF engine in fp32; more for vLLM, bf16, or top-k/top-p sampling)
            policy = b["old_logprobs_BR"] if "old_logprobs_BR" in b else b["rollout_logprobs_BR"]
            values = (policy[index] - b["ref_logprobs_BR"][index])[mask]
        elif quantity == "Δ log p trainer − engine":  # the mismatch monitor, token by token
            if "old_logprobs_BR" not in b or "rollout_logprobs_BR" not in b:
                raise UsageError("this batch has no trainer log-probs beside the engine's: prepare() it with "
                                 "algo.reuse_logprobs=false")
            values = (b["old_logprobs_BR"][index] - b["rollout_logprobs_BR"][index])[mask]
        else:
            field = TOKEN_FIELDS.get(quantity)
            if field == "old_logprobs_BR" and field not in b:  # algo.reuse_logprobs: the sampler's are the same
                field = "rollout_logprobs_BR"
            if field is None or field not in b:
                raise UsageError(f"'{quantity}' is not in this batch; prepare() it first")
            values = b[field][index][mask]
        return list(zip(token_pieces(self.tokenizer, ids), map(float, values.tolist())))

    def turns(self, index: int, quantity: str = "log-prob") -> list[dict]:
        """The episode of sample `index` as consecutive segments {"who": "model" | "environment", "text",
        "tokens": [(token text, value)]}: `loss_mask_BR` runs of 1 are the model's, of 0 the environment's
        (a batch without it is one model turn). Environment tokens carry None: they are not trained on.
        "text" is the segment decoded whole, special tokens dropped, as the response column shows it."""
        toks = self.token_colors(index, quantity)
        b = self.batch
        mask = b["response_mask_BR"][index].bool()
        ids = b["response_ids_BR"][index][mask].tolist()
        mine = b["loss_mask_BR"][index][mask].bool().tolist() if "loss_mask_BR" in b else [True] * len(ids)
        out, start = [], 0
        for model, run in groupby(mine):
            end = start + len(list(run))
            out.append({"who": "model" if model else "environment",
                        "text": self.tokenizer.decode(ids[start:end], skip_special_tokens=True),
                        "tokens": [(t, v if model else None) for t, v in toks[start:end]]})
            start = end
        return out

    # ---- the widget ---------------------------------------------------------------------------------
    def table_html(self) -> str:
        rows = self.view()[: self.page_size]
        head = "".join(f"<th>{c}</th>" for c in ("#",) + self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r[c]))}</td>" for c in ("index",) + self.columns)
                       + "</tr>" for r in rows)
        return (f"<div>{len(self.view())} of {len(self.rows)} samples</div>"
                f"<table class='rl-inspector' style='font-size:12px'><tr>{head}</tr>{body}</table>")

    def tokens_html(self, index: int, quantity: str) -> str:
        try:
            toks = self.token_colors(index, quantity)
        except ValueError as e:
            return f"<i>{html.escape(str(e))}</i>"
        lo, hi = _scale(v for _, v in toks)
        spans = "".join(_token_span(text, v, lo, hi) for text, v in toks)
        return f"<div>{html.escape(quantity)}: {lo:.3f} … {hi:.3f}</div><div>{spans}</div>"

    def turns_html(self, index: int, quantity: str) -> str:
        """The episode one turn under the other: the model's tokens coloured as in `tokens_html` (on one scale
        over all its turns), the environment's as plain text; the episode's reward, turns and tool calls below."""
        try:
            segments = self.turns(index, quantity)
        except ValueError as e:
            return f"<i>{html.escape(str(e))}</i>"
        b = self.batch
        lo, hi = _scale(v for s in segments if s["who"] == "model" for _, v in s["tokens"])
        calls = _at(b, "tool_calls_B", index)
        label = "tool result" if calls else "environment"  # an episode that called tools was answered by them
        parts, n = [], 0
        for s in segments:
            if s["who"] == "model":
                n += 1
                body = "".join(_token_span(t, v, lo, hi) for t, v in s["tokens"])
                parts.append(_turn(f"model, turn {n}", body))
            else:
                parts.append(_turn(label, html.escape(s["text"]), "background:#eee;color:#333;font-family:monospace;"
                                   "white-space:pre-wrap;padding:2px 4px;border-radius:3px"))
        reward = _at(b, "scores_B", index)  # the scored reward; a batch fresh from its episodes has the env's
        facts = {"reward": reward if reward is not None else _at(b, "env_scores_B", index),
                 "turns": _at(b, "num_turns_B", index), "tool calls": calls,
                 "tool errors": _at(b, "tool_errors_B", index), "env error:": _at(b, "env_error", index) or None}
        footer = " · ".join(f"{k} {_fmt(v)}" for k, v in facts.items() if v is not None)
        return (f"<div>{html.escape(quantity)}: {lo:.3f} … {hi:.3f}</div>{''.join(parts)}"
                f"<div style='font-size:11px;color:#555'>{html.escape(footer)}</div>")

    def token_pane_html(self, index: int, quantity: str) -> str:
        """What the widget's token pane shows: an episode turn by turn, a single response as one line."""
        if self.batch is not None and "loss_mask_BR" in self.batch:
            return self.turns_html(index, quantity)
        return self.tokens_html(index, quantity)

    def _changed(self) -> Inspector:
        if self._widget is not None:
            self._table.value = self.table_html()
        return self

    @property
    def widget(self):
        if self._widget is None:
            self._build()
        return self._widget

    def _build(self) -> None:
        import ipywidgets as W
        col = W.Dropdown(options=self.columns, value="reward", description="filter")
        op = W.Dropdown(options=list(OPS), value="==", layout={"width": "90px"})
        val = W.Text(placeholder="value", layout={"width": "120px"})
        add = W.Button(description="add filter")
        clear = W.Button(description="clear")
        sort = W.Dropdown(options=("index",) + self.columns, value="index", description="sort")
        desc = W.Checkbox(description="descending", value=False)
        sample = W.BoundedIntText(value=0, min=0, max=max(len(self.rows) - 1, 0), description="sample #")
        quantity = W.Dropdown(options=list(TOKEN_FIELDS), value="log-prob", description="colour by")
        self._table = W.HTML(self.table_html())
        tokens = W.HTML()
        add.on_click(lambda _: self.add_filter(col.value, op.value, val.value))
        clear.on_click(lambda _: self.clear_filters())
        sort.observe(lambda ch: self.sort(ch["new"], desc.value), names="value")
        desc.observe(lambda ch: self.sort(sort.value, ch["new"]), names="value")
        def show(*_):
            tokens.value = self.token_pane_html(sample.value, quantity.value)

        sample.observe(show, names="value")
        quantity.observe(show, names="value")
        show()
        self._widget = W.VBox([W.HBox([col, op, val, add, clear]), W.HBox([sort, desc]), self._table,
                               W.HBox([sample, quantity]), tokens])

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)

    def __repr__(self) -> str:
        lines = [f"Inspector({len(self.view())} of {len(self.rows)} samples)"]
        for r in self.view()[:10]:
            lines.append("  " + "  ".join(f"{c}={_fmt(r[c])}" for c in ("index",) + self.columns))
        return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _at(batch, field: str, i: int):
    """Sample i's `field` as a plain value; None when the batch has no such field."""
    if field not in batch:
        return None
    v = batch[field][i]
    return v.item() if hasattr(v, "item") else v


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's piece of the decoded text, so that the pieces join into the response as it reads. A
    byte-level tokenizer splits a character of several UTF-8 bytes (’, é, 日, an emoji) over tokens that decode
    alone as '\ufffd' each: such a character goes to the token that completes it, the tokens before it show
    ''. Decoded in a window from the last complete piece, as streaming detokenizers do (TGI's decode_token):
    linear in the length, and the window keeps a SentencePiece word's leading space where it belongs."""
    pieces, prefix, read, shown = [], 0, 0, ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[prefix:i + 1])
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            pieces.append(text[len(shown):])
            prefix, read = read, i + 1
            shown = tokenizer.decode(ids[prefix:read])
        else:
            pieces.append("")
    if read < len(ids):  # the response ends inside a character (a cut-off multi-byte token): show what it is
        pieces[-1] = tokenizer.decode(ids[prefix:])[len(shown):]
    return pieces


def _scale(values) -> tuple[float, float]:
    vals = list(values) or [0.0]
    return min(vals), max(vals)


def _token_span(text: str, v: float, lo: float, hi: float) -> str:
    """One token, red at `lo` to green at `hi`, its value on hover; the text escaped."""
    t = (v - lo) / (hi - lo) if hi > lo else 0.5
    color = f"rgba({int(255 * (1 - t))},{int(180 * t)},80,0.45)"
    return (f"<span title='{v:.4f}' style='background:{color};padding:1px 2px;margin:1px;"
            f"border-radius:3px;font-family:monospace;white-space:pre-wrap'>{html.escape(text)}</span>")


def _turn(label: str, body: str, style: str = "") -> str:
    """One turn of an episode: its label above its (already escaped) body."""
    return (f"<div style='margin:4px 0'><div style='font-size:11px;color:#777'>{html.escape(label)}</div>"
            f"<div style='{style}'>{body}</div></div>")


def inspect(source, tokenizer=None) -> Inspector:
    """`rl.inspect(batch)` or `rl.inspect("runs/x/rollouts/step_000050.jsonl")`."""
    return Inspector(source, tokenizer=tokenizer)
