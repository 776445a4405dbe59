"""`sess.dashboard()`: live training curves, throughput, memory and a phase timeline.

Redraws are throttled (at most one per `min_interval_s`) and each curve keeps at most `max_points`
points (long runs are decimated), so a 10,000-step run stays smooth. The figures are updated in one
`batch_update` per redraw from whichever thread finished the step: one writer at a time.
"""
from __future__ import annotations

import html
import threading
import time

PANELS = [  # (title, [(metric key, trace name)])
    ("reward", [("reward/mean", "mean")]),
    ("held-out accuracy", [("eval/accuracy", "greedy")]),
    ("response length", [("response_len/mean", "mean")]),
    ("KL", [("kl/ref", "to reference"), ("actor/approx_kl", "old→new")]),
    ("train–inference mismatch |Δ log p|", [("mismatch/logp_abs_mean", "mean"), ("mismatch/logp_abs_max", "max")]),
    ("entropy", [("entropy", "entropy")]),
    ("loss", [("loss/policy", "policy"), ("loss/value", "value")]),
    ("clip fraction", [("actor/clip_frac", "clip")]),
    ("grad norm", [("actor/grad_norm", "policy"), ("critic/grad_norm", "critic")]),
    ("throughput tok/s", [("throughput/rollout_tok_s", "rollout"), ("throughput/prepare_tok_s", "prepare"),
                          ("throughput/update_tok_s", "update")]),
]
COLS = 4


def decimate(xs: list, max_points: int) -> list:
    """Every k-th item (and always the last) so at most about `max_points` remain."""
    if len(xs) <= max_points:
        return xs
    k = -(-len(xs) // max_points)
    out = xs[::k]
    return out if out[-1] is xs[-1] else out + [xs[-1]]


class Dashboard:
    def __init__(self, session, max_points: int = 500, min_interval_s: float = 0.3, timeline_steps: int = 4):
        import ipywidgets as W
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        self.session, self.max_points, self.min_interval_s = session, max_points, min_interval_s
        self.timeline_steps = timeline_steps
        self.redraws = 0
        self._last = 0.0
        self._lock = threading.Lock()
        titles = [p[0] for p in PANELS] + ["memory GB (peak RSS)"]
        rows = -(-len(titles) // COLS)
        fig = make_subplots(rows=rows, cols=COLS, subplot_titles=titles, horizontal_spacing=0.08, vertical_spacing=0.14)
        self._slots: list[tuple[str, int]] = []  # (metric key, trace index)
        for i, (_, series) in enumerate(PANELS):
            r, c = divmod(i, COLS)
            if series[0][0] == "reward/mean":  # min-max band under the mean
                for key, name in (("reward/max", "max"), ("reward/min", "min")):
                    fig.add_trace(go.Scatter(x=[], y=[], name=name, mode="lines", line={"width": 0},
                                             fill="tonexty" if key == "reward/min" else None,
                                             fillcolor="rgba(99,110,250,0.2)", showlegend=False), row=r + 1, col=c + 1)
                    self._slots.append((key, len(fig.data) - 1))
            for key, name in series:
                fig.add_trace(go.Scatter(x=[], y=[], name=name, mode="lines+markers" if key.startswith("eval/")
                                         else "lines", showlegend=False), row=r + 1, col=c + 1)
                self._slots.append((key, len(fig.data) - 1))
        self._memory_cell = divmod(len(PANELS), COLS)
        fig.update_layout(height=240 * rows, margin={"l": 40, "r": 10, "t": 40, "b": 20}, template="plotly_white",
                          legend={"title": "memory", "x": 1.0, "y": 0.0, "yanchor": "bottom"})
        fig.update_annotations(font_size=12)
        self.figure = go.FigureWidget(fig)
        self.timeline = go.FigureWidget(layout={"height": 220, "barmode": "overlay", "template": "plotly_white",
                                                "title": "phase timeline (last steps)", "xaxis": {"title": "s"},
                                                "margin": {"l": 90, "r": 10, "t": 40, "b": 30}})
        self.status = W.HTML()
        buttons = []
        for label, fn in (("Pause", session.pause), ("Resume", session.resume), ("Stop", session.stop)):
            b = W.Button(description=label, layout={"width": "90px"})
            b.on_click(lambda _b, fn=fn: (fn(), self.refresh(force=True)))
            buttons.append(b)
        self.buttons = buttons
        self.widget = W.VBox([W.HBox([self.status, *buttons]), self.figure, self.timeline])
        self._unsubscribe = session.on_step(self._on_step)
        self.refresh(force=True)

    # ---- drawing --------------------------------------------------------------------------------
    def _on_step(self, _row) -> None:
        self.refresh(force=_row is None)

    def refresh(self, force: bool = False) -> bool:
        """Redraw from the session's history; skipped if the last redraw was under min_interval_s ago."""
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return False
        with self._lock:
            self._last = now
            self._draw()
            self.redraws += 1
        return True

    def _series(self, key: str) -> tuple[list, list]:
        rows = self.session.evals if key.startswith("eval/") else self.session.history
        pts = decimate([(r["step"], r[key]) for r in rows if r.get(key) is not None], self.max_points)
        return [p[0] for p in pts], [p[1] for p in pts]

    def _draw(self) -> None:
        import plotly.graph_objects as go
        fig = self.figure
        with fig.batch_update():
            for key, idx in self._slots:
                fig.data[idx].x, fig.data[idx].y = self._series(key)
            self._draw_memory(go)
        self._draw_timeline(go)
        self.status.value = self._status_html()

    def overlay(self, *runs) -> Dashboard:
        """Draw branches' curves (sess.fork / sess.branch) dashed over the main line's, in the same panels."""
        import plotly.graph_objects as go
        for run in runs:
            for i, (_, series) in enumerate(PANELS):
                x, y = run.curve(series[0][0])
                if not x:
                    continue
                r, c = divmod(i, COLS)
                self.figure.add_trace(go.Scatter(x=x, y=y, name=run.name, legendgroup=f"branch:{run.name}",
                                                 mode="lines+markers" if len(x) < 20 else "lines",
                                                 line={"dash": "dash"}, showlegend=False), row=r + 1, col=c + 1)
        return self

    def _draw_memory(self, go) -> None:
        roles = sorted({k.split("/")[1].removesuffix("_peak_gb") for r in self.session.history[-1:]
                        for k in r if k.startswith("memory/")})
        r, c = self._memory_cell
        existing = {t.name: t for t in self.figure.data if getattr(t, "legendgroup", None) == "memory"}
        for role in roles:
            x, y = self._series(f"memory/{role}_peak_gb")
            if role in existing:
                existing[role].x, existing[role].y = x, y
            else:
                self.figure.add_trace(go.Scatter(x=x, y=y, name=role, legendgroup="memory", mode="lines"),
                                      row=r + 1, col=c + 1)

    def timeline_bars(self) -> list[dict]:
        """Phase calls of the last `timeline_steps` steps: lane 'role/rank', start and duration in seconds."""
        records = [rec for g in self.session.groups.values() for rec in getattr(g, "records", [])
                   if rec.method not in ("memory", "info", "__init__")]
        if not records:
            return []
        updates = sorted(r.end for r in records if r.role == "policy" and r.method == "update")
        since = (updates[-self.timeline_steps - 1] if len(updates) > self.timeline_steps
                 else min(r.start for r in records))
        recent = [r for r in records if r.end >= since]
        t0 = min(r.start for r in recent)
        return [{"lane": f"{r.role}/{r.rank}", "method": r.method, "start": r.start - t0, "duration": r.end - r.start}
                for r in recent]

    def _draw_timeline(self, go) -> None:
        bars = self.timeline_bars()
        by_method: dict[str, list[dict]] = {}
        for b in bars:
            by_method.setdefault(b["method"], []).append(b)
        traces = [go.Bar(y=[b["lane"] for b in bs], x=[b["duration"] for b in bs], base=[b["start"] for b in bs],
                         orientation="h", name=m) for m, bs in sorted(by_method.items())]
        with self.timeline.batch_update():
            self.timeline.data = []
            for t in traces:
                self.timeline.add_trace(t)

    def _status_html(self) -> str:
        s = self.session
        bg = s.background
        state = bg.state if bg is not None else s.state
        color = {"running": "#1a7f37", "paused": "#9a6700", "failed": "#cf222e"}.get(state, "#57606a")
        last = s.history[-1] if s.history else {}
        parts = [f"<b style='color:{color}'>{state}</b>", f"step {s.step_count}"]
        if "reward/mean" in last:
            parts.append(f"reward {last['reward/mean']:.3f}")
        if "time/step_s" in last:
            parts.append(f"{last['time/step_s']:.2f} s/step")
        if s.evals:
            parts.append(f"held-out acc {s.evals[-1]['eval/accuracy']:.3f}")
        if last.get("mismatch/alarm"):
            parts.append("<span style='color:#9a6700'>engine and trainer log-probs differ: mean |Δ log p| "
                         f"{last['mismatch/logp_abs_mean']:.4f} (algo.mismatch_alarm)</span>")
        err = bg.error if bg is not None else None
        if err is not None:
            parts.append("<span style='color:#cf222e'>"
                         f"{html.escape(type(err).__name__ + ': ' + str(err))[:300]}</span>")
        return " · ".join(parts)

    def points(self) -> int:
        """Points currently drawn in all curves (what tests and the browser check)."""
        return sum(len(t.x or ()) for t in self.figure.data)

    def close(self) -> None:
        self._unsubscribe()
        self.widget.close()

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
