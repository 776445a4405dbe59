"""A run as one HTML file to share: `dash.save("report.html")` from a live session, or
`rlbench-nb report RUN_DIR` from a run directory's files alone (a finished batch run, a colleague's folder).

The file holds the header row, the dashboard's three sections (widgets/figures.py, the same pictures), the
summary, rollout samples from rollouts/step_N.jsonl (a few per saved step, spread over the run) and the
config. plotly.js is written inside, so it opens in a browser with no kernel, server or network.
"""
from __future__ import annotations

import html
import json
import os
import threading
import time
from pathlib import Path

from .errors import UsageError
from .metrics.sinks import read_jsonl
from .metrics.trackers import SAMPLE_COLUMNS, sample_rows
from .widgets.figures import SECTIONS, TITLE, decimate, header_facts, header_html, section_figure, section_traces

SAMPLE_STEPS = 8     # saved rollout files shown, spread over the run
SAMPLES_PER_STEP = 4  # samples of each, spread over its groups


def load_run(run_dir: str | Path) -> dict:
    """What a report needs from a run directory: training rows, evaluation rows, config and summary."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise UsageError(f"{run_dir} is not a run directory (no metrics.jsonl): give the folder a run wrote, "
                         "e.g. runs/arith-grpo")
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int)]
    config_path = run_dir / "config.yaml"
    return {"history": [r for r in rows if "reward/mean" in r],
            "evals": [r for r in rows if "eval/accuracy" in r],
            "summary": read_summary(run_dir),
            "config_yaml": config_path.read_text() if config_path.exists() else ""}


def read_summary(run_dir: str | Path) -> dict | None:
    """summary.json of the run's last finished run(), or None (none yet, torn, or not ours)."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.exists() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # the curves still tell the story
    return summary if isinstance(summary, dict) else None


def samples(run_dir: str | Path, steps: int = SAMPLE_STEPS, per_step: int = SAMPLES_PER_STEP) -> list[list]:
    """Rows (SAMPLE_COLUMNS) of `per_step` samples from about `steps` saved rollout files, spread evenly over
    the run (always the last one)."""
    files = sorted(f for f in Path(run_dir, "rollouts").glob("step_*.jsonl") if f.stem[5:].isdigit())
    out = []
    for f in decimate(files, steps):
        out += sample_rows(int(f.stem[5:]), read_jsonl(f), per_step)
    return out


def report_from_run_dir(run_dir: str | Path, out: str | Path | None = None, smoothing: float = 0.0) -> Path:
    """`rlbench-nb report RUN_DIR`: the report of a run directory, by default RUN_DIR/report.html."""
    run = load_run(run_dir)
    h, summary = run["history"], run["summary"]
    ended = summary is not None and h and summary.get("steps") == h[-1].get("step")  # the summary is the last word
    state = ("stopped" if summary.get("stopped") else "finished") if ended else "unfinished"
    facts = header_facts(h, run["evals"], state, summary.get("target", summary.get("steps")) if ended else None)
    return write_report(out or Path(run_dir) / "report.html", run_dir, history=h, evals=run["evals"], facts=facts,
                        summary=summary, config_yaml=run["config_yaml"], smoothing=smoothing)


def write_report(path: str | Path, run_dir: str | Path, *, history: list[dict], evals: list[dict], facts: dict,
                 summary: dict | None, config_yaml: str, smoothing: float = 0.0, timeline=None) -> Path:
    import plotly.io as pio
    from plotly.offline import get_plotlyjs
    path, run_dir = Path(path), Path(run_dir)
    plot = {"full_html": False, "include_plotlyjs": False, "config": {"responsive": True, "displaylogo": False}}
    body = [f"<h1>{html.escape(run_dir.name)}</h1>",
            f"<p class='meta'>{html.escape(str(run_dir.resolve()))} · report written "
            f"{time.strftime('%Y-%m-%d %H:%M')}</p>", header_html(facts)]
    if summary:
        body.append(_summary_html(summary))
    for s in SECTIONS:
        traces = section_traces(s, history, evals, smoothing)
        figure = pio.to_html(section_figure(s, traces), **plot)
        body += [f"<h2>{TITLE[s]}</h2>", f"<div class='rl-curves'>{figure}</div>"]
    if timeline is not None and timeline.data:
        body += ["<h2>Phase timeline</h2>", pio.to_html(timeline, **plot)]
    rows = samples(run_dir)
    body.append(_samples_html(rows))
    if rows:  # a click on any curve jumps to the samples of the nearest step shown
        body.append(f"<script>{_CLICK_TO_SAMPLES % json.dumps(sorted({r[0] for r in rows}))}</script>")
    body.append(f"<h2>Config</h2><details><summary>config.yaml</summary><pre>{html.escape(config_yaml)}</pre></details>")
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>rlbench-nb · {html.escape(run_dir.name)}</title>"
            f"<style>{_CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head>"
            f"<body>{''.join(body)}</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    try:
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(path)  # a reader never sees half a report
    finally:
        tmp.unlink(missing_ok=True)
    return path


def held_out_name(key: str) -> str:
    """A summary's `eval_before_after` key as people read it: 'part/gsm8k_format' -> 'gsm8k_format'."""
    return "answer length (tokens)" if key == "response_len" else key.removeprefix("part/")


def _summary_html(s: dict) -> str:
    def num(v, fmt=".3f"):
        return format(v, fmt) if isinstance(v, int | float) and not isinstance(v, bool) else "—"
    rows = [("held-out accuracy", f"{num(s.get('accuracy_before'))} → {num(s.get('accuracy_after'))} "
                                  f"({num(s.get('accuracy_gain'), '+.3f')}, {s.get('eval_prompts', '?')} prompts)"),
            *[(f"held-out {held_out_name(k)}", f"{num(b)} → {num(a)}")
              for k, (b, a) in (s.get("eval_before_after") or {}).items()],
            ("train reward", f"{num(s.get('reward_first'))} (first steps) → {num(s.get('reward_last'))} (last steps)"),
            ("steps", f"{s.get('steps')} ({s.get('steps_this_run')} in the last run"
                      + (", stopped before its end" if s.get("stopped") else "") + ")"),
            ("wall time", f"{s.get('wall_s')} s")]
    cells = "".join(f"<tr><th>{k}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<h2>Summary</h2><table class='summary'>{cells}</table>"


def _samples_html(rows: list[list]) -> str:
    if not rows:
        return "<h2>Rollout samples</h2><p class='meta'>none saved (run.save_rollouts_every=0)</p>"

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return html.escape("" if v is None else str(v))
    head = "".join(f"<th>{c}</th>" for c in SAMPLE_COLUMNS)
    steps = sorted({r[0] for r in rows})
    first = {}  # each step's first row carries its anchor (#samples-step-N): the links and the curves lead there
    for i, r in enumerate(rows):
        first.setdefault(r[0], i)
    body = "".join((f"<tr id='samples-step-{r[0]}'>" if first[r[0]] == i else "<tr>")
                   + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for i, r in enumerate(rows))
    links = " · ".join(f"<a href='#samples-step-{s}'>{s}</a>" for s in steps)
    return (f"<h2>Rollout samples</h2><p class='meta'>{SAMPLES_PER_STEP} per saved step, spread over its groups, "
            f"from rollouts/. Steps: {links} (or click a step on any curve above)</p>"
            f"<table class='samples'><tr>{head}</tr>{body}</table>")


# plotly.js's click event on every figure: scroll to the nearest step whose samples the page holds, and mark it
_CLICK_TO_SAMPLES = """(steps => document.querySelectorAll('.rl-curves .js-plotly-plot').forEach(
 gd => gd.on('plotly_click', e => {
  const x = e.points[0].x;
  const step = steps.reduce((a, b) => Math.abs(b - x) < Math.abs(a - x) ? b : a);
  const row = document.getElementById('samples-step-' + step);
  document.querySelectorAll('tr.picked').forEach(r => r.classList.remove('picked'));
  row.classList.add('picked');
  row.scrollIntoView({block: 'center'});
})))(%s);"""


_CSS = """body{font-family:-apple-system,BlinkMacSystemFont,'Segoe UI',sans-serif;margin:24px 32px;color:#24292f}
h1{font-size:22px;margin:0}h2{font-size:16px;margin:28px 0 4px;border-bottom:1px solid #d0d7de}
.meta{color:#57606a;font-size:12px}table{border-collapse:collapse;font-size:13px}
th,td{border-bottom:1px solid #eaeef2;padding:4px 10px;text-align:left;vertical-align:top}
table.samples td{white-space:pre-wrap;font-family:ui-monospace,monospace;max-width:520px}
pre{background:#f6f8fa;padding:10px;font-size:12px}tr.picked td{background:#fff8c5}"""
