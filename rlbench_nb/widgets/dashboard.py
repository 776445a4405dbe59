"""`sess.dashboard()`: the live view of a run — a header row, then outcome, policy and system sections
(widgets/figures.py draws them), and a phase timeline; `dash.save("report.html")` keeps it as a file.

Redraws are throttled (at most one per `min_interval_s`) and each curve keeps at most `max_points`
points (long runs are decimated), so a 10,000-step run stays smooth. Each figure is updated in one
`batch_update` per redraw, from whichever thread finished the step, under one lock: one writer at a time.
"""
from __future__ import annotations

import html
import threading
import time
from pathlib import Path

from .figures import (
    SECTIONS,
    TITLE,
    decimate,
    header_facts,
    header_html,
    layout_key,
    section_figure,
    section_traces,
    timeline_figure,
)
from .step_samples import caption_html, nearest_saved

__all__ = ["Dashboard", "decimate"]


# plotly.js sizes a figure when JupyterLab first shows it, often before the output area has its width, and
# keeps plotly's default 700 px as a fixed width. The header, when shown and after the figures were laid out
# anew, clears that width and fires a resize a moment later; the figures are "responsive" (they re-fit on a
# resize), so the sections fill the cell's width and follow the window.
_FIT_WIDTH = ("<img src='data:image/none,' alt='' style='display:none' onerror=\"setTimeout(() => {"
              "document.querySelectorAll('.rl-dashboard .js-plotly-plot').forEach(g => {"
              "if (g.layout && g.layout.width) delete g.layout.width; });"
              "window.dispatchEvent(new Event('resize')); }, 1000)\">")


class Dashboard:
    def __init__(self, session, max_points: int = 500, min_interval_s: float = 0.3, timeline_steps: int = 4,
                 smoothing: float = 0.0):
        import ipywidgets as W
        import plotly.graph_objects as go

        self.session, self.max_points, self.min_interval_s = session, max_points, min_interval_s
        self.timeline_steps, self.smoothing = timeline_steps, smoothing
        self.redraws = 0
        self._last = 0.0
        self._lock = threading.Lock()
        self._overlays: list[tuple[str, list, list]] = []
        self.figures = {s: go.FigureWidget(section_figure(s, [])) for s in SECTIONS}
        self.timeline = go.FigureWidget(timeline_figure([], timeline_steps))
        for fig in [*self.figures.values(), self.timeline]:  # plotly.js config: fit the output area on a resize
            fig._config = {**fig._config, "responsive": True}
        self._layouts: dict[str, tuple] = {s: () for s in SECTIONS}  # figures.layout_key of what is drawn
        self._fit = True  # the header carries _FIT_WIDTH once after the figures were (re)laid out
        self.header = W.HTML()
        self.smoother = W.FloatSlider(value=smoothing, min=0.0, max=0.99, step=0.01, description="smoothing",
                                      continuous_update=False, readout_format=".2f", layout={"width": "260px"})
        self.smoother.observe(lambda change: self.smooth(change["new"]), names="value")
        self.buttons = []
        for label, fn in (("Pause", session.pause), ("Resume", session.resume), ("Stop", session.stop)):
            b = W.Button(description=label, layout={"width": "80px"})
            b.on_click(lambda _b, fn=fn: (fn(), self.refresh(force=True)))
            self.buttons.append(b)
        title = "<div style='font:600 14px sans-serif;margin:10px 0 0 4px;color:#24292f'>{}</div>"
        parts = [W.HBox([self.header, W.HBox([self.smoother, *self.buttons])],
                        layout={"justify_content": "space-between", "align_items": "flex-end", "width": "100%"})]
        for s, fig in self.figures.items():
            parts += [W.HTML(title.format(TITLE[s])), fig]
        for fig in self.figures.values():
            self._clickable(fig)
        self.samples = W.VBox([W.HTML("<span style='color:#57606a'>Click a step on any curve: its saved samples "
                                      "open here.</span>")])
        self.samples.add_class("rl-samples")
        self._opened: tuple | None = None
        self._inspector = None
        self.widget = W.VBox(parts + [self.timeline, W.HTML(title.format("Samples")), self.samples],
                             layout={"width": "100%"})
        self.widget.add_class("rl-dashboard")  # where _FIT_WIDTH looks
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

    def smooth(self, weight: float) -> Dashboard:
        """EMA smoothing of the noisy curves, 0 (off) to 0.99 (TensorBoard's slider; raw lines stay faint)."""
        if not 0.0 <= weight < 1.0:
            raise ValueError(f"smoothing must be in [0, 1): got {weight}")
        self.smoothing = weight
        if self.smoother.value != weight:
            self.smoother.value = weight  # observed: comes back here with the same value
        self.refresh(force=True)
        return self

    def _traces(self, section: str) -> list[dict]:
        s = self.session
        return section_traces(section, s.history, s.evals, self.smoothing, self.max_points, self._overlays)

    def _draw(self) -> None:
        for section, fig in self.figures.items():
            traces = self._traces(section)
            key = layout_key(traces)
            if key == self._layouts[section]:  # the same lines, modes and ticks: move their points
                with fig.batch_update():
                    for trace, t in zip(fig.data, traces):
                        trace.x, trace.y = t["x"], t["y"]
            else:  # a line appeared (a metric's first value, a branch, smoothing), a mode or the ticks changed
                new = section_figure(section, traces)
                with fig.batch_update():
                    fig.data = []
                    fig.add_traces(list(new.data))
                    fig.layout = new.layout
                self._clickable(fig)  # new traces: the click handlers go with them
                self._layouts[section], self._fit = key, True
                # a layout replaced in plotly.js keeps the width it had as a fixed one; set and cleared, the
                # width is free again, and the next resize (_FIT_WIDTH) fits it to the cell
                fig.layout.width = 10
                fig.layout.width = None
        bars = self.timeline_bars()
        new = timeline_figure(bars, self.timeline_steps)
        with self.timeline.batch_update():
            self.timeline.data = []
            self.timeline.add_traces(list(new.data))
            self.timeline.layout.height = new.layout.height
        self.header.value = self._header_html()

    # ---- from a curve to its samples -------------------------------------------------------------
    def _clickable(self, fig) -> None:
        for trace in fig.data:
            trace.on_click(self._clicked)

    def _clicked(self, trace, points, _state) -> None:
        key = str(trace.meta or "")  # the metric (figures.section_figure)
        if points.xs and not key.startswith("branch:"):  # a branch's samples are in its own folder
            self.open_step(points.xs[0], "eval" if key.startswith("eval/") else "train")

    def open_step(self, step: float, kind: str = "train"):
        """What clicking a curve does: the rollouts saved nearest `step` open in the inspector under the
        dashboard, with a caption naming the step shown. kind 'train' (rollouts/step_N.jsonl) or 'eval'
        (rollouts/eval_step_N.jsonl, every evaluation's greedy responses). Returns the Inspector, or None
        when nothing is saved yet (the caption says which setting saves it)."""
        import ipywidgets as W

        from .inspector import Inspector
        s = self.session
        found = nearest_saved(s.run_dir, step, kind)
        opened = (kind, step, found[0] if found else None)
        if opened == self._opened and found:  # plotly calls each trace of the clicked panel: open it once
            return self._inspector
        inspector = Inspector(found[1], tokenizer=s.tokenizer) if found else None
        caption = W.HTML(caption_html(step, kind, found, s.cfg.run.save_rollouts_every))
        self.samples.children = [caption] + ([inspector.widget] if inspector else [])
        self._opened, self._inspector = opened, inspector
        return inspector

    def overlay(self, *runs) -> Dashboard:
        """Draw branches' curves (sess.fork / sess.branch) and replays dashed over the main line's, in the
        same panels, with their names in the panels' legends."""
        for run in runs:
            history = getattr(run, "history", None)
            self._overlays = [o for o in self._overlays if o[0] != run.name]  # drawn again, not twice
            self._overlays.append((run.name, history if history is not None else [run.row],
                                   getattr(run, "evals", [])))
        self.refresh(force=True)
        return self

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

    def facts(self) -> dict:
        """The header's numbers (figures.header_facts) for this session. The state is the background run's
        (running, paused, finished, stopped, failed), or how the last run() ended while nothing has moved
        since, or the session's own (ready, running, needs_resync, closed)."""
        s = self.session
        bg = s.background
        if bg is not None and not bg.done:
            state = bg.state
        elif s.state == "ready" and s.progress.run_outcome and s.step_count == s.progress.run_end_step:
            state = s.progress.run_outcome
        else:
            state = s.state
        return header_facts(s.history, s.evals, state, s.progress.run_target)

    def _header_html(self) -> str:
        s = self.session
        last = s.history[-1] if s.history else {}
        notes = []
        if last.get("mismatch/alarm"):
            notes.append("<span style='color:#9a6700'>engine and trainer log-probs differ: mean |Δ log p| "
                         f"{last['mismatch/logp_abs_mean']:.4f} (algo.mismatch_alarm)</span>")
        err = s.background.error if s.background is not None else None
        if err is not None:
            notes.append("<span style='color:#cf222e'>"
                         f"{html.escape(type(err).__name__ + ': ' + str(err))[:300]}</span>")
        fit, self._fit = (_FIT_WIDTH if self._fit else ""), False
        return header_html(self.facts(), " · ".join(notes)) + fit

    def points(self) -> int:
        """Points currently drawn in all curves (what tests and the browser check)."""
        return sum(len(t.x or ()) for fig in self.figures.values() for t in fig.data)

    # ---- sharing --------------------------------------------------------------------------------
    def save(self, path: str | Path = "report.html") -> Path:
        """A standalone HTML file of this run — the header, every section, the phase timeline, the config,
        the summary (once a run wrote one) and rollout samples from the run directory — that opens in any
        browser without a kernel or a network (plotly.js is inside)."""
        from ..report import read_summary, write_report
        s = self.session
        summary = read_summary(s.run_dir)  # the last run's, if it ended where the session is now
        summary = summary if summary and summary.get("steps") == s.step_count else None
        return write_report(path, s.run_dir, history=s.history, evals=s.evals, facts=self.facts(),
                            summary=summary, config_yaml=s.cfg.to_yaml(), smoothing=self.smoothing,
                            timeline=timeline_figure(self.timeline_bars(), self.timeline_steps))

    def close(self) -> None:
        self._unsubscribe()
        self.widget.close()

    def _ipython_display_(self):
        from IPython.display import display
        self._fit = True  # a new view: fit it to its cell
        self.refresh(force=True)
        display(self.widget)
