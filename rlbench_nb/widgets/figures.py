"""The dashboard's pictures as pure functions of metric rows: the live widget (dashboard.py) and the shared
report (report.py) draw the same figures from the same rows, in memory or read back from metrics.jsonl.

Three sections a researcher scans top-down — outcome, policy, system — each one plotly figure of panels.
Every panel with more than one line has its own legend in its corner; every x axis is the step; noisy
curves can be smoothed with an EMA (debiased, as TensorBoard's slider), the raw line kept faint beneath.
"""
from __future__ import annotations

import html
import math

# section -> panels: (title, [(metric key, line name)]). "memory/*" expands to one line per role, "reward/part/*"
# and "eval/part/*" to one per part of a combined reward (rewards/scored.py), each named by its part.
STALENESS_HISTOGRAM = "async/staleness:histogram"  # a panel of bars: steps per `async/staleness` value
THROUGHPUT = "throughput (tok/s, log scale)"
SECTIONS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "outcome": [
        ("reward", [("reward/mean", "mean"), ("reward/part/*", "")]),  # the mean over its min–max band
        ("held-out (greedy)", [("eval/accuracy", "accuracy"), ("eval/part/*", "")]),
        ("response length (tokens)", [("response_len/mean", "mean"), ("response_len/max", "max"),
                                      ("eval/response_len", "held-out mean")]),
    ],
    "policy": [
        ("loss", [("loss/policy", "policy"), ("loss/value", "value"), ("loss/kl", "KL term")]),
        ("KL", [("kl/ref", "to reference"), ("actor/approx_kl", "old → new")]),
        ("entropy", [("entropy", "entropy")]),
        ("clip fraction", [("actor/clip_frac", "clipped"), ("actor/clip_frac_lower", "dual-clipped")]),
        ("grad norm", [("actor/grad_norm", "policy"), ("critic/grad_norm", "critic")]),
        ("train–inference mismatch |Δ log p|", [("mismatch/logp_abs_mean", "mean"),
                                                ("mismatch/logp_abs_max", "max")]),
    ],
    "system": [
        (THROUGHPUT, [("throughput/rollout_tok_s", "rollout"), ("throughput/prepare_tok_s", "prepare"),
                      ("throughput/update_tok_s", "update")]),
        ("seconds per phase", [("time/rollout_s", "rollout"), ("time/score_s", "score"),
                               ("time/prepare_s", "prepare"), ("time/update_s", "update")]),
        ("memory, peak RSS (GB)", [("memory/*", "")]),
        # run(async_rollout=True, max_staleness=k): how stale the trained batches were, and who waited
        ("async: batches by staleness", [(STALENESS_HISTOGRAM, "batches")]),
        ("async: idle share of each step", [("async/rollout_idle", "rollout"), ("async/trainer_idle", "trainer")]),
    ],
}
COLS = 3
SMOOTHED = ("reward/", "loss/", "kl/", "actor/", "critic/", "entropy", "mismatch/", "response_len/")  # EMA applies
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
TITLE = {"outcome": "Outcome", "policy": "Policy", "system": "System"}


def decimate(xs: list, max_points: int) -> list:
    """Every k-th item (and always the last) so at most about `max_points` remain."""
    if len(xs) <= max_points:
        return xs
    k = -(-len(xs) // max_points)
    out = xs[::k]
    return out if out[-1] is xs[-1] else out + [xs[-1]]


def ema(ys: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average debiased at the start (so the first point
    is the first value, not pulled toward 0). weight 0 returns `ys`; NaN/None points pass through."""
    if not weight:
        return list(ys)
    out, last, n = [], 0.0, 0
    for y in ys:
        if y is None or not math.isfinite(y):
            out.append(y)
            continue
        n += 1
        last = last * weight + (1 - weight) * y
        out.append(last / (1 - weight ** n))
    return out


def series(rows: list[dict], key: str, max_points: int | None = None) -> tuple[list, list]:
    """(steps, values) of `key` in `rows` that have it, decimated to about `max_points` (None: all)."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    pts = decimate(pts, max_points) if max_points else pts
    return [p[0] for p in pts], [p[1] for p in pts]


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _lines(panel: list[tuple[str, str]], history: list[dict], evals: list[dict]) -> list[tuple[str, str]]:
    """The panel's (key, name) lines, its wildcards expanded over the keys the rows have."""
    out = []
    for key, name in panel:
        if key == "memory/*":
            roles = sorted({k[len("memory/"):-len("_peak_gb")] for r in history[-1:] for k in r
                            if k.startswith("memory/") and k.endswith("_peak_gb")})
            out += [(f"memory/{role}_peak_gb", role) for role in roles]
        elif key.endswith("/*"):
            prefix = key[:-1]
            keys = dict.fromkeys(k for r in (evals if key.startswith("eval/") else history) for k in r
                                 if k.startswith(prefix))
            out += [(k, k[len(prefix):]) for k in keys]
        else:
            out.append((key, name))
    return out


def section_traces(section: str, history: list[dict], evals: list[dict], smoothing: float = 0.0,
                   max_points: int = 500, overlays=()) -> list[dict]:
    """The traces of one section as plain dicts, each with "panel" (its index) and a stable "uid".
    `overlays`: (name, history, evals) of branches, drawn dashed in every panel they have data for."""
    out = []
    for p, (_, panel) in enumerate(SECTIONS[section]):
        if panel[0][0] == STALENESS_HISTOGRAM:
            out += _histogram(p, [r["async/staleness"] for r in history if r.get("async/staleness") is not None])
            continue
        lines = [(k, n, series(evals if k.startswith("eval/") else history, k))
                 for k, n in _lines(panel, history, evals)]
        lines = [(k, n, xy) for k, n, xy in lines if xy[0]]
        legend = len(lines) > 1
        for i, (key, name, (x, y)) in enumerate(lines):
            color = COLORS[i % len(COLORS)]
            if key == "reward/mean":  # min–max band under the mean
                lo, hi = series(history, "reward/min", max_points), series(history, "reward/max", max_points)
                out.append({"uid": "reward/max", "panel": p, "x": hi[0], "y": hi[1], "name": "max",
                            "mode": "lines", "line": {"width": 0}, "showlegend": False, "hoverinfo": "skip"})
                out.append({"uid": "reward/min", "panel": p, "x": lo[0], "y": lo[1], "name": "min–max",
                            "mode": "lines", "line": {"width": 0}, "fill": "tonexty", "showlegend": False,
                            "fillcolor": "rgba(76,114,176,0.15)", "hoverinfo": "skip"})
            smooth = smoothing if key.startswith(SMOOTHED) else 0.0
            keep = decimate(list(range(len(x))), max_points)  # smoothed over every step, then thinned out
            smoothed = ema(y, smooth)
            x, y, smoothed = [x[i] for i in keep], [y[i] for i in keep], [smoothed[i] for i in keep]
            if smooth:  # the raw curve stays visible, faint, under the smoothed one
                out.append({"uid": f"{key}:raw", "panel": p, "x": x, "y": y, "name": name, "mode": "lines",
                            "line": {"color": color, "width": 1}, "opacity": 0.25, "showlegend": False,
                            "hoverinfo": "skip"})
            out.append({"uid": key, "panel": p, "x": x, "y": smoothed, "name": name,
                        "mode": "lines+markers" if key.startswith("eval/") or len(x) < 3 else "lines",
                        "line": {"color": color, "width": 2}, "showlegend": legend,
                        "hovertemplate": f"{name}: %{{y:.4g}}<extra></extra>"})
        for name, b_history, b_evals in overlays:
            for key, _, _ in lines[:1]:
                x, y = series(b_evals if key.startswith("eval/") else b_history, key, max_points)
                if x:
                    out.append({"uid": f"branch:{name}:{key}", "panel": p, "x": x, "y": y, "name": name,
                                "mode": "lines+markers" if len(x) < 20 else "lines", "line": {"dash": "dash"},
                                "showlegend": True, "legendgroup": f"branch:{name}"})
    return out


def _histogram(panel: int, values: list[float]) -> list[dict]:
    """Bars: how many steps trained a batch that many updates behind (none when no step ran async)."""
    if not values:
        return []
    x = sorted(set(values))
    return [{"uid": STALENESS_HISTOGRAM, "panel": panel, "x": x, "y": [values.count(v) for v in x], "name": "batches",
             "mode": "bar", "marker": {"color": COLORS[0]}, "showlegend": False,
             "hovertemplate": "%{y} steps %{x} updates behind<extra></extra>"}]


def section_figure(section: str, traces: list[dict]):
    """A plotly Figure of the section's panels holding `traces` (section_traces): one legend per
    multi-line panel, in its top-right corner; "step" on every x axis; hover shows every line at a step."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    # the async panels only where a step ran async: empty, they took a third of the section in every other run
    drawn = {t["panel"] for t in traces}
    shown = [p for p, (_, keys) in enumerate(SECTIONS[section])
             if p in drawn or not all(k.startswith("async/") for k, _ in keys)]
    place = {p: i for i, p in enumerate(shown)}  # SECTIONS' panel index -> its place in this figure
    panels = [SECTIONS[section][p] for p in shown]
    rows = -(-len(panels) // COLS)
    fig = make_subplots(rows=rows, cols=COLS, subplot_titles=[t for t, _ in panels], horizontal_spacing=0.14,
                        vertical_spacing=0.22 if rows > 1 else 0.1)
    legends: dict[int, str] = {}
    for t in traces:
        t = dict(t)
        t["meta"] = t["uid"]  # a FigureWidget gives its traces uids of its own: the key travels in `meta`
        p = place[t.pop("panel")]
        r, c = divmod(p, COLS)
        if t.get("showlegend"):
            t["legend"] = legends.setdefault(p, "legend" if not legends else f"legend{len(legends) + 1}")
        if t.get("mode") == "bar":
            t.pop("mode")
            fig.add_trace(go.Bar(**t), row=r + 1, col=c + 1)
        else:
            fig.add_trace(go.Scatter(**t), row=r + 1, col=c + 1)
    for p, name in legends.items():  # beside its panel, top-aligned: never over the curves
        sub = fig.get_subplot(*(i + 1 for i in divmod(p, COLS)))
        fig.update_layout({name: {"x": sub.xaxis.domain[1] + 0.005, "y": sub.yaxis.domain[1], "xanchor": "left",
                                  "yanchor": "top", "font": {"size": 10}, "tracegroupgap": 0,
                                  "itemwidth": 30}})
    # whole steps: a short run gets one tick per step instead of 1.5, 2.5
    fig.update_xaxes(title_text="step", title_standoff=4, title_font_size=11, dtick=1 if _short(traces) else None)
    # small numbers as 2e-9, not plotly's SI "2n"; counts (tokens/s, GB) keep 4M / 1.2k; 0 always in view
    fig.update_yaxes(exponentformat="e" if section == "policy" else "SI", separatethousands=True, rangemode="tozero")
    for p, (title, panel) in enumerate(panels):
        if panel[0][0] == STALENESS_HISTOGRAM:  # its x axis counts updates, not steps
            fig.update_xaxes(title_text="updates behind", dtick=1, row=p // COLS + 1, col=p % COLS + 1)
        if title == THROUGHPUT:  # prepare runs at ~10^5-10^6 tok/s, rollout and update at ~10^2-10^4: on one
            # linear axis two of the three lines lie flat on zero; a log axis keeps each readable in one panel
            fig.update_yaxes(type="log", row=p // COLS + 1, col=p % COLS + 1)
    fig.update_annotations(font_size=13)
    fig.update_layout(height=250 * rows + 20, template="plotly_white", hovermode="x unified",
                      margin={"l": 50, "r": 20, "t": 30, "b": 40}, autosize=True)
    return fig


def _short(traces: list[dict]) -> bool:
    return max((x for t in traces for x in t["x"][-1:] if _finite(x)), default=0) <= 8


def layout_key(traces: list[dict]) -> tuple:
    """What section_figure's layout depends on: the lines, their modes, the step ticks. Traces with the same key
    fit the same figure (only their points differ)."""
    return tuple((t["uid"], t["mode"]) for t in traces) + (_short(traces),)


def header_facts(history: list[dict], evals: list[dict], state: str, target: int | None) -> dict:
    """The header row's numbers: step / total, steps/s and ETA (from the last 10 steps' wall time), the last
    reward and held-out accuracy, and the state as it is (running, paused, finished, stopped, failed)."""
    step = history[-1]["step"] if history and _finite(history[-1].get("step")) else 0
    recent = [r["time/step_s"] for r in history[-10:] if _finite(r.get("time/step_s")) and r["time/step_s"] > 0]
    per_step = sum(recent) / len(recent) if recent else None
    live = state in ("running", "paused")
    return {
        "state": state, "step": step, "target": target if _finite(target) and target >= step else None,
        "steps_per_s": 1 / per_step if per_step else None,
        "eta_s": (target - step) * per_step if live and per_step and _finite(target) and target > step else None,
        "reward": history[-1].get("reward/mean") if history and _finite(history[-1].get("reward/mean")) else None,
        "accuracy": evals[-1].get("eval/accuracy") if evals and _finite(evals[-1].get("eval/accuracy")) else None,
        "accuracy_step": evals[-1].get("step") if evals else None,
    }


def duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


STATE_COLORS = {"running": "#1a7f37", "paused": "#9a6700", "failed": "#cf222e", "stopped": "#9a6700",
                "finished": "#0969da"}


def header_html(f: dict, extra: str = "") -> str:
    """The header row as HTML cells: what a researcher glances at first."""
    state = html.escape(str(f["state"]))
    cells = [("state", f"<b style='color:{STATE_COLORS.get(f['state'], '#57606a')}'>{state}</b>"),
             ("step", f"{f['step']}" + (f" / {f['target']}" if f["target"] else ""))]  # numbers (header_facts)
    if f["steps_per_s"]:
        cells.append(("steps/s", f"{f['steps_per_s']:.2f}"))
    if f["eta_s"] is not None:
        cells.append(("ETA", duration(f["eta_s"])))
    if f["reward"] is not None:
        cells.append(("reward", f"{f['reward']:.3f}"))
    if f["accuracy"] is not None:
        cells.append((f"held-out acc (step {html.escape(str(f['accuracy_step']))})", f"{f['accuracy']:.3f}"))
    body = "".join(f"<div class='rl-cell'><div class='rl-label'>{k}</div><div class='rl-value'>{v}</div></div>"
                   for k, v in cells)
    return (f"<div class='rl-header' style='display:flex;gap:28px;align-items:flex-end;font-family:sans-serif'>"
            f"<style>.rl-label{{font-size:11px;color:#57606a}}.rl-value{{font-size:18px}}</style>{body}</div>"
            + (f"<div style='margin-top:4px'>{extra}</div>" if extra else ""))


def timeline_figure(bars: list[dict], steps: int):
    """Phase calls as horizontal bars, one lane per role/rank, coloured by method (named in the legend)."""
    import plotly.graph_objects as go
    by_method: dict[str, list[dict]] = {}
    for b in bars:
        by_method.setdefault(b["method"], []).append(b)
    fig = go.Figure([go.Bar(y=[b["lane"] for b in bs], x=[b["duration"] for b in bs], base=[b["start"] for b in bs],
                            orientation="h", name=m, hovertemplate=f"{m}: %{{x:.3f}} s<extra>%{{y}}</extra>")
                     for m, bs in sorted(by_method.items())])
    rows = max(4, len({b["lane"] for b in bars}), len(by_method))  # lanes, and the legend without a scrollbar
    fig.update_layout(height=90 + 28 * rows, barmode="overlay",
                      template="plotly_white",
                      title={"text": f"phase timeline (last {steps} steps)", "font": {"size": 13}},
                      xaxis={"title": {"text": "seconds"}}, legend={"title": {"text": "phase"}},
                      margin={"l": 90, "r": 20, "t": 40, "b": 40}, autosize=True)
    return fig
