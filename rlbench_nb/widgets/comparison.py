"""`sess.compare(a, b, ...)`: branches and replays side by side — a table of metric values and their
differences from the first, and the curves overlaid (one panel per metric, one colour per run).

    cmp = sess.compare(low, high)
    cmp.table()          # [{"metric": "reward/mean", "lr-1e-4": 0.41, "lr-1e-3": 0.47, "Δ lr-1e-3": 0.06}, ...]
    cmp                  # in a notebook: the figure and the table
"""
from __future__ import annotations

import html

DEFAULT_METRICS = ("reward/mean", "eval/accuracy", "loss/policy", "actor/clip_frac", "actor/approx_kl",
                   "actor/grad_norm", "kl/ref", "entropy", "response_len/mean", "advantage/abs_max")
COLS = 3


def _value(run, metric: str, last: int) -> float | None:
    """The mean of a metric over a run's last `last` rows (its last evaluation for eval/ metrics)."""
    _, ys = run.curve(metric)
    if not ys:
        return None
    ys = ys[-1:] if metric.startswith("eval/") else ys[-last:]
    return sum(ys) / len(ys)


def _check_asked(runs: list, asked: list[str], shown: list[str]) -> None:
    """Metrics asked for by name: one that no run has but that is close to one they have is a typo, said with
    the nearest; none shown at all is said with what the runs have. (A real metric with no value yet, e.g.
    eval/accuracy of forks that never evaluated, is left out, as the defaults are.)"""
    import difflib

    from ..errors import UsageError
    known = sorted({k for r in runs for row in [*getattr(r, "history", ()), *getattr(r, "evals", ()),
                                              getattr(r, "row", {})] for k in row} - {"step"})
    have = f"they have: {', '.join(known[:30])}{' ...' if len(known) > 30 else ''}"
    for m in asked:
        near = [] if m in known else difflib.get_close_matches(m, known, n=1)
        if near and m not in shown:
            raise UsageError(f"no run to compare has metric '{m}' (did you mean '{near[0]}'?); {have}")
    if not shown:
        raise UsageError(f"no run to compare has any of {asked}; {have}")


class Comparison:
    def __init__(self, runs: list, metrics: list[str] | None = None, last: int = 5):
        from ..errors import UsageError
        if not runs:
            raise UsageError("compare what? pass branches (sess.fork / sess.branch) or replays (sess.replay)")
        for r in runs:
            if not (hasattr(r, "name") and hasattr(r, "curve")):
                raise UsageError(f"sess.compare takes branches (sess.fork / sess.branch) or replays (sess.replay), "
                                 f"got {type(r).__name__}")
        self.runs, self.last = runs, last
        names = [r.name for r in runs]
        if len(set(names)) != len(names):
            raise UsageError(f"runs to compare need distinct names, got {names}")
        wanted = [metrics] if isinstance(metrics, str) else metrics or DEFAULT_METRICS
        self.metrics = [m for m in wanted if any(r.curve(m)[1] for r in runs)]
        if metrics:
            _check_asked(runs, wanted, self.metrics)

    def table(self) -> list[dict]:
        """One row per metric: each run's value, and each later run's difference from the first."""
        first = self.runs[0]
        out = []
        for m in self.metrics:
            row = {"metric": m}
            base = _value(first, m, self.last)
            for r in self.runs:
                v = _value(r, m, self.last)
                row[r.name] = v
                if r is not first:
                    row[f"Δ {r.name}"] = None if v is None or base is None else v - base
            out.append(row)
        return out

    def figure(self):
        """A plotly FigureWidget: one panel per metric, every run's curve in it (a replay is one point)."""
        import plotly.graph_objects as go
        from plotly.colors import qualitative
        from plotly.subplots import make_subplots
        rows = -(-len(self.metrics) // COLS) or 1
        fig = make_subplots(rows=rows, cols=COLS, subplot_titles=self.metrics, horizontal_spacing=0.08,
                            vertical_spacing=0.16)
        for j, run in enumerate(self.runs):
            colour = qualitative.Plotly[j % len(qualitative.Plotly)]
            for i, m in enumerate(self.metrics):
                x, y = run.curve(m)
                r, c = divmod(i, COLS)
                fig.add_trace(go.Scatter(x=x, y=y, name=run.name, legendgroup=run.name, showlegend=i == 0,
                                         mode="lines+markers" if len(x) < 20 else "lines",
                                         line={"color": colour}), row=r + 1, col=c + 1)
        fig.update_layout(height=230 * rows, template="plotly_white", margin={"l": 40, "r": 10, "t": 40, "b": 20})
        fig.update_annotations(font_size=12)
        return go.FigureWidget(fig)

    def _table_html(self) -> str:
        rows = self.table()
        cols = list(rows[0]) if rows else ["metric"]

        def fmt(v) -> str:
            return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
                       for r in rows)
        return f"<table class='rl-compare'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def _repr_html_(self) -> str:
        return self._table_html()

    def _ipython_display_(self):
        from IPython.display import HTML, display
        display(self.figure())
        display(HTML(self._table_html()))

    def __repr__(self) -> str:
        rows = self.table()
        names = [r.name for r in self.runs]
        lines = [f"{'metric':<22}" + "".join(f"{n[:14]:>16}" for n in names)]
        for row in rows:
            lines.append(f"{row['metric']:<22}" + "".join(
                f"{row[n]:>16.4g}" if row[n] is not None else f"{'-':>16}" for n in names))
        return "\n".join(lines)
