"""`sess.inspect(batch)` / `rl.inspect(batch_or_rollouts_file)`: find the samples worth looking at.

A table of samples (prompt, response, reward, advantage, length, reward error) that sorts and filters
(`reward == 0`, `length > 3`, `response contains 7`), and a token view of one response coloured by
log-prob, KL to the reference, or advantage. Rollout content is only ever shown as escaped text, never
executed or rendered as HTML.
"""
from __future__ import annotations

import html
import json
import operator
from pathlib import Path

from ..errors import UsageError

OPS = {"==": operator.eq, "!=": operator.ne, ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
       "contains": lambda a, b: str(b) in str(a)}
COLUMNS = ("prompt", "response", "reward", "reward_before", "advantage", "length", "reward_error")
TOKEN_FIELDS = {"log-prob": "old_logprobs_BR", "KL to reference": None, "advantage": "advantages_BR",
                "Δ log p trainer − engine": None}


def _table_row(i: int, shown: dict) -> dict:
    """One inspector row from a sample keyed by the names people see (`Batch.rows()`, rollout files; their
    token ids stay out of the table). `reward_before`: a re-scored batch's earlier reward, beside the new."""
    return {"index": i, **{c: shown.get(c, "" if c in ("prompt", "response") else None) for c in COLUMNS}}


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
        self.page_size = page_size
        self.filters: list[tuple[str, str, object]] = []
        self.sort_key, self.descending = "index", False
        self._widget = None

    # ---- the model (testable without a browser) --------------------------------------------------
    def add_filter(self, column: str, op: str, value) -> Inspector:
        if column not in COLUMNS + ("index",):
            raise UsageError(f"unknown column '{column}'; use one of {COLUMNS}")
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
            raise UsageError("token views need a batch and a tokenizer (saved rollout files hold text only)")
        b = self.batch
        mask = b["response_mask_BR"][index].bool()
        ids = b["response_ids_BR"][index][mask].tolist()
        if quantity == "KL to reference":
            if "ref_logprobs_BR" not in b:
                raise UsageError("this batch has no reference log-probs (algo.kl_coef is 0)")
            values = (b["old_logprobs_BR"][index] - b["ref_logprobs_BR"][index])[mask]
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
        return [(self.tokenizer.decode([t]), float(v)) for t, v in zip(ids, values.tolist())]

    # ---- the widget ---------------------------------------------------------------------------------
    def table_html(self) -> str:
        rows = self.view()[: self.page_size]
        head = "".join(f"<th>{c}</th>" for c in ("#",) + COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r[c]))}</td>" for c in ("index",) + COLUMNS) + "</tr>"
                       for r in rows)
        return (f"<div>{len(self.view())} of {len(self.rows)} samples</div>"
                f"<table class='rl-inspector' style='font-size:12px'><tr>{head}</tr>{body}</table>")

    def tokens_html(self, index: int, quantity: str) -> str:
        try:
            toks = self.token_colors(index, quantity)
        except ValueError as e:
            return f"<i>{html.escape(str(e))}</i>"
        vals = [v for _, v in toks] or [0.0]
        lo, hi = min(vals), max(vals)
        spans = []
        for text, v in toks:
            t = (v - lo) / (hi - lo) if hi > lo else 0.5
            color = f"rgba({int(255 * (1 - t))},{int(180 * t)},80,0.45)"
            spans.append(f"<span title='{v:.4f}' style='background:{color};padding:1px 2px;margin:1px;"
                         f"border-radius:3px;font-family:monospace'>{html.escape(text)}</span>")
        return f"<div>{quantity}: {lo:.3f} … {hi:.3f}</div><div>{''.join(spans)}</div>"

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
        col = W.Dropdown(options=COLUMNS, value="reward", description="filter")
        op = W.Dropdown(options=list(OPS), value="==", layout={"width": "90px"})
        val = W.Text(placeholder="value", layout={"width": "120px"})
        add = W.Button(description="add filter")
        clear = W.Button(description="clear")
        sort = W.Dropdown(options=("index",) + COLUMNS, value="index", description="sort")
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
            tokens.value = self.tokens_html(sample.value, quantity.value)

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
            lines.append("  " + "  ".join(f"{c}={_fmt(r[c])}" for c in ("index",) + COLUMNS))
        return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def inspect(source, tokenizer=None) -> Inspector:
    """`rl.inspect(batch)` or `rl.inspect("runs/x/rollouts/step_000050.jsonl")`."""
    return Inspector(source, tokenizer=tokenizer)
