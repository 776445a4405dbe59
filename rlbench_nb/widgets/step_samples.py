"""From a curve to its samples: a step on a dashboard curve (or on the report's) -> the rollouts saved nearest
to it. Training curves lead to rollouts/step_N.jsonl (written every `run.save_rollouts_every` steps), held-out
curves to rollouts/eval_step_N.jsonl (every evaluation's greedy responses). Not every step is saved, so the
nearest saved one is shown, and the caption says when it is not the step asked for.
"""
from __future__ import annotations

import html
from pathlib import Path

KINDS = {"train": "step", "eval": "eval_step"}  # curve kind -> rollout file prefix (rundir.write_rollouts)


def saved_steps(run_dir: str | Path, kind: str = "train") -> dict[int, Path]:
    """{step: file} of the rollouts saved for `kind` ('train' or 'eval')."""
    prefix = KINDS[kind] + "_"
    out = {}
    for f in Path(run_dir, "rollouts").glob(f"{prefix}*.jsonl"):
        number = f.stem[len(prefix):]
        if number.isdigit():
            out[int(number)] = f
    return out


def nearest_saved(run_dir: str | Path, step: float, kind: str = "train") -> tuple[int, Path] | None:
    """The saved step nearest `step` (the earlier one on a tie) and its file; None when none is saved."""
    saved = saved_steps(run_dir, kind)
    if not saved:
        return None
    best = min(saved, key=lambda s: (abs(s - step), s))
    return best, saved[best]


def caption_html(step: float, kind: str, found: tuple[int, Path] | None, every: int) -> str:
    """What the samples pane says above the inspector: which step is shown and why that one."""
    what = "held-out responses" if kind == "eval" else "rollouts"
    asked = int(step) if float(step).is_integer() else step
    if found is None:
        fix = ("an evaluation writes them (run.eval_every, sess.evaluate())" if kind == "eval"
               else "run.save_rollouts_every=N saves them every N steps")
        return f"<b>step {asked}</b>: no {what} saved in this run yet; {html.escape(fix)}"
    saved, path = found
    where = html.escape(f"{path.parent.name}/{path.name}")
    if saved == step:
        return f"<b>{what.capitalize()} of step {saved}</b> · {where}"
    why = f" (saved every {every} steps)" if kind == "train" and every else ""
    return (f"<b>{what.capitalize()} of step {saved}</b>, the nearest saved to step {asked}{why} · {where}")
