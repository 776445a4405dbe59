"""Dashboard and inspector state, checked in Python (the browser test looks at the rendering)."""
import json

import pytest

import rlbench_nb as rl
from rlbench_nb.widgets.dashboard import decimate


def test_decimate_bounds_points_and_keeps_the_last():
    xs = list(range(1234))
    out = decimate(xs, 100)
    assert len(out) <= 101 and out[0] == 0 and out[-1] == 1233
    assert decimate(xs[:50], 100) == xs[:50]


def test_dashboard_draws_every_panel_and_the_timeline(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false", "algo.kl_coef=0.05"))
    dash = sess.dashboard(max_points=2)
    assert dash.points() == 0
    sess.evaluate()
    for _ in range(3):
        sess.step()
    dash.refresh(force=True)
    traces = {t.name: t for t in dash.figure.data}
    assert list(traces["mean"].x) == [2, 3] or list(traces["mean"].x) == [1, 3]  # decimated to ~max_points
    assert len(traces["greedy"].y) == 1 and len(traces["to reference"].y) >= 1
    assert {"policy", "rollout", "reward", "reference"} <= {t.name for t in dash.figure.data
                                                            if t.legendgroup == "memory"}
    lanes = {b["lane"] for b in dash.timeline_bars()}
    assert {"policy/0", "rollout/0", "reward/0", "reference/0"} <= lanes
    assert all(b["duration"] >= 0 and b["start"] >= 0 for b in dash.timeline_bars())
    assert "step 3" in dash.status.value and "reward" in dash.status.value


def test_dashboard_redraws_are_throttled(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    dash = sess.dashboard()
    dash.min_interval_s = 3600
    before = dash.redraws
    for _ in range(3):
        sess.step()
    assert dash.redraws == before  # steps came faster than the interval: no redraw
    assert dash.refresh(force=True) and dash.redraws == before + 1


def test_inspector_filters_sorts_and_colours_tokens(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false", "algo.kl_coef=0.05"))
    batch = sess.prepare(sess.score(sess.rollout()))
    insp = sess.inspect(batch)
    wrong = insp.add_filter("reward", "==", "0").view()
    assert wrong and all(r["reward"] == 0.0 for r in wrong)
    assert len(wrong) == int((batch["scores_B"] == 0).sum())
    insp.clear_filters().add_filter("length", ">", "2")
    assert all(r["length"] > 2 for r in insp.view())
    insp.clear_filters().sort("advantage", descending=True)
    advs = [r["advantage"] for r in insp.view()]
    assert advs == sorted(advs, reverse=True)
    toks = insp.token_colors(0, "log-prob")
    assert "".join(t for t, _ in toks).startswith(batch["response"][0])
    assert all(v <= 0 for _, v in toks)
    kl = insp.token_colors(0, "KL to reference")
    assert len(kl) == len(toks)
    assert "<span" in insp.tokens_html(0, "advantage") and "of 32 samples" in insp.table_html()
    with pytest.raises(ValueError, match="unknown column 'rewrd'"):
        insp.add_filter("rewrd", "==", 0)


def test_inspector_on_saved_rollouts_escapes_content(small_cfg, tmp_path):
    path = tmp_path / "step_000001.jsonl"
    path.write_text(json.dumps({"prompt": "<script>alert(1)</script>", "response": "1", "scores_B": 1.0}) + "\n")
    insp = rl.inspect(path)
    assert "&lt;script&gt;" in insp.table_html() and "<script>" not in insp.table_html()
    with pytest.raises(ValueError, match="token views need a batch"):
        insp.token_colors(0)
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    sess.step()  # run.save_rollouts_every=1
    assert len(sess.inspect().rows) == 32


def test_background_failure_shows_in_the_dashboard_and_is_raised_next_time(small_cfg, monkeypatch):
    import asyncio
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    dash = sess.dashboard()

    def broken(*a, **k):
        raise ValueError("loss exploded")
    monkeypatch.setattr(sess.groups["policy"].workers[0], "update", broken)

    async def main():
        run = sess.run(steps=5, background=True)
        await run
        return run
    run = asyncio.run(main())
    assert run.state == "failed" and "loss exploded" in str(run.error)
    assert "failed" in dash.status.value and "loss exploded" in dash.status.value
    with pytest.raises(RuntimeError, match="the background run failed at step 1: WorkerError: policy rank 0"):
        sess.run(steps=1, progress=False)
    monkeypatch.undo()
    assert sess.run(steps=1, progress=False)["steps"] == 1  # raised once, then the session carries on
