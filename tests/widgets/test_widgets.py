"""Dashboard and inspector state, checked in Python (the browser test looks at the rendering)."""
import json

import pytest

import rlbench_nb as rl
from rlbench_nb.cli import main as cli
from rlbench_nb.report import report_from_run_dir
from rlbench_nb.widgets.figures import SECTIONS, decimate, ema, header_facts, section_figure, section_traces


def test_decimate_bounds_points_and_keeps_the_last():
    xs = list(range(1234))
    out = decimate(xs, 100)
    assert len(out) <= 101 and out[0] == 0 and out[-1] == 1233
    assert decimate(xs[:50], 100) == xs[:50]


def test_ema_is_tensorboards_debiased_smoothing():
    # by hand, weight 0.5: 0.5*1 / (1 - 0.5) = 1; (0.5*0.5 + 0.5*3) / (1 - 0.25) = 1.75 / 0.75 = 7/3;
    # pure Python floats: the same on every CPU, so only the last bit of the division is left to tolerance
    assert ema([1.0, 3.0], 0.5) == pytest.approx([1.0, 7 / 3], rel=1e-15)
    gap = ema([1.0, None, 3.0], 0.5)  # a missing value passes through and does not count
    assert gap[1] is None and gap[::2] == pytest.approx([1.0, 7 / 3], rel=1e-15)
    assert ema([2.0, 5.0], 0.0) == [2.0, 5.0]


def test_async_runs_get_a_staleness_histogram_and_idle_lines():
    history = [{"step": s + 1, "async/staleness": float(min(s, 2)), "async/rollout_idle": 0.1 * s,
                "async/trainer_idle": 0.5} for s in range(5)]
    traces = {t["uid"]: t for t in section_traces("system", history, [])}
    bars = traces["async/staleness:histogram"]
    assert bars["mode"] == "bar" and bars["x"] == [0.0, 1.0, 2.0] and bars["y"] == [1, 1, 3]  # 0, 1, then 2 x3
    assert traces["async/rollout_idle"]["y"] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    fig = section_figure("system", list(traces.values()))
    assert [t.type for t in fig.data if t.uid == "async/staleness:histogram"] == ["bar"]
    assert "updates behind" in [ax.title.text for ax in fig.select_xaxes()]
    assert len(fig.layout.annotations) == 5  # every panel's title
    # a synchronous run: no async numbers, and no async panels taking a third of the section empty
    sync = [{"step": 1, "time/rollout_s": 1.0, "throughput/rollout_tok_s": 60.0, "throughput/prepare_tok_s": 4e5}]
    traces = section_traces("system", sync, [])
    assert not [t for t in traces if t["uid"].startswith("async/")]
    fig = section_figure("system", traces)
    assert [a.text for a in fig.layout.annotations] == ["throughput (tok/s, log scale)", "seconds per phase",
                                                        "memory, peak RSS (GB)"]
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type != "log"  # 60 and 4e5 both readable


def test_a_combined_rewards_parts_are_drawn_beside_the_reward_and_the_held_out_accuracy():
    history = [{"step": s, "reward/mean": 0.1 * s, "reward/part/gsm8k": 0.0, "reward/part/gsm8k_format": 0.2 * s}
               for s in (1, 2)]
    evals = [{"step": 0, "eval/accuracy": 0.0, "eval/part/gsm8k_format": 0.06, "eval/response_len": 95.0},
             {"step": 2, "eval/accuracy": 0.0, "eval/part/gsm8k_format": 1.0, "eval/response_len": 44.0}]
    traces = {t["uid"]: t for t in section_traces("outcome", history, evals)}
    assert traces["reward/part/gsm8k_format"]["name"] == "gsm8k_format" and traces["reward/part/gsm8k"]["panel"] == 0
    held_out = traces["eval/part/gsm8k_format"]
    assert held_out["panel"] == traces["eval/accuracy"]["panel"] == 1 and held_out["y"] == [0.06, 1.0]
    assert traces["eval/response_len"]["x"] == [0, 2] and traces["eval/response_len"]["panel"] == 2


def test_header_facts_give_total_rate_and_eta():
    history = [{"step": s, "time/step_s": 0.5, "reward/mean": s / 10} for s in range(1, 5)]
    f = header_facts(history, [{"step": 0, "eval/accuracy": 0.25}], "running", target=10)
    assert (f["step"], f["target"], f["steps_per_s"], f["eta_s"]) == (4, 10, 2.0, 3.0)  # 6 steps x 0.5 s
    assert (f["reward"], f["accuracy"]) == (0.4, 0.25)
    done = header_facts(history, [], "finished", target=4)
    assert done["eta_s"] is None and done["target"] == 4


def test_dashboard_draws_sections_with_legends_and_step_axes(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false", "algo.kl_coef=0.05"))
    dash = sess.dashboard(max_points=2)
    assert dash.points() == 0
    sess.evaluate()
    for _ in range(3):
        sess.step()
    dash.refresh(force=True)
    outcome, policy, system = (dash.figures[s] for s in SECTIONS)
    traces = {t.name: t for t in outcome.data}
    assert list(traces["mean"].x) == [2, 3] or list(traces["mean"].x) == [1, 3]  # decimated to ~max_points
    assert len(traces["accuracy"].y) == 1
    kl = [t for t in policy.data if t.name in ("to reference", "old → new")]
    assert len(kl) == 2 and kl[0].legend == kl[1].legend and kl[0].showlegend  # named, in the KL panel's legend
    for fig in dash.figures.values():  # each legend placed (beside its panel), none left at plotly's default
        for name in {t.legend for t in fig.data if t.showlegend}:
            assert fig.layout[name].xanchor == "left" and fig.layout[name].yanchor == "top"
    memory = [t for t in system.data if t.xaxis == "x3"]  # the third panel: one line per role
    assert {"policy", "rollout", "reward", "reference"} <= {t.name for t in memory}
    assert {t.name for t in system.data if t.xaxis == "x"} == {"rollout", "prepare", "update"}
    for fig in dash.figures.values():
        assert all(ax.title.text in ("step", "updates behind") for ax in fig.select_xaxes())
    lanes = {b["lane"] for b in dash.timeline_bars()}
    assert {"policy/0", "rollout/0", "reward/0", "reference/0"} <= lanes
    assert all(b["duration"] >= 0 and b["start"] >= 0 for b in dash.timeline_bars())
    assert {t.name for t in dash.timeline.data} >= {"generate", "update"}  # phases named in the legend
    assert dash.facts()["step"] == 3 and ">ready</b>" in dash.header.value and "reward" in dash.header.value
    dash.smooth(0.9)  # a faint raw line under each smoothed noisy curve
    raw = {(t.name, t.xaxis): t for t in outcome.data if t.opacity == 0.25}
    checked = set()
    for trace in [t for t in outcome.data if t.opacity is None and (t.name, t.xaxis) in raw]:
        faint = raw[(trace.name, trace.xaxis)]
        key = next(k for k in sess.history[-1]  # the metric whose steps the faint raw line shows
                   if [sess.history[step - 1].get(k) for step in faint.x] == list(faint.y))
        # smoothed over every step, then thinned out: the EMA of all steps read at the steps kept (not the EMA
        # of the kept points)
        every = ema([row[key] for row in sess.history], 0.9)
        assert list(trace.y) == pytest.approx([every[step - 1] for step in trace.x], rel=1e-12)
        checked.add(key)
    assert {"reward/mean", "response_len/mean"} <= checked
    with pytest.raises(ValueError, match="smoothing"):
        dash.smooth(1.0)
    assert outcome.layout.xaxis.dtick == 1  # a short run: one tick per step
    for _ in range(7):
        sess.step()
    dash.refresh(force=True)  # past 8 steps: plotly's own ticks, plain lines (redrawn, not only moved)
    assert outcome.layout.xaxis.dtick is None and {t.mode for t in outcome.data if t.name == "mean"} == {"lines"}


def _click(fig, metric, step):
    """What plotly.js sends when the point of `metric`'s trace at `step` is clicked, through the FigureWidget's own
    dispatch (the browser test clicks with the mouse)."""
    from plotly.callbacks import InputDeviceState, Points
    i = next(k for k, t in enumerate(fig.data) if t.meta == metric)
    trace = fig.data[i]
    at = list(trace.x).index(step)
    state = InputDeviceState(ctrl=False, alt=False, shift=False, meta=False, button=0, buttons=1)
    trace._dispatch_on_click(Points(point_inds=[at], xs=[step], ys=[trace.y[at]], trace_name=trace.name,
                                    trace_index=i), state)


def test_a_click_on_a_curve_opens_the_nearest_saved_steps_samples(small_cfg):
    """Training curves open rollouts/step_N.jsonl, held-out ones rollouts/eval_step_N.jsonl; a step that was
    not saved opens the nearest saved one and says so; nothing saved says which setting saves it. The
    handlers survive a redraw that replaces the traces."""
    sess = rl.Session(small_cfg("run.tensorboard=false", "run.save_rollouts_every=2"))
    dash = sess.dashboard()
    assert dash.open_step(1) is None and "run.save_rollouts_every" in dash.samples.children[0].value
    sess.evaluate()
    for _ in range(4):
        sess.step()
    sess.evaluate()
    dash.refresh(force=True)  # new lines appeared since the first draw: traces replaced, handlers re-attached
    outcome = dash.figures["outcome"]
    _click(outcome, "reward/mean", 3)  # saved at 2 and 4: 3 is as near to both, the earlier is shown
    caption = dash.samples.children[0].value
    assert "of step 2</b>, the nearest saved to step 3 (saved every 2 steps)" in caption, caption
    shown = dash._inspector
    saved = (sess.run_dir / "rollouts" / "step_000002.jsonl").read_text().splitlines()
    assert len(shown.rows) == len(saved) == 32 and shown.rows[0]["prompt"] == json.loads(saved[0])["prompt"]
    assert dash.samples.children[1] is shown.widget  # the inspector itself, under the caption
    _click(outcome, "reward/mean", 4)
    assert "Rollouts of step 4</b> · rollouts/step_000004.jsonl" in dash.samples.children[0].value
    _click(outcome, "eval/accuracy", 4)  # the held-out curve: that evaluation's greedy responses
    assert "Held-out responses of step 4</b> · rollouts/eval_step_000004.jsonl" in dash.samples.children[0].value
    assert len(dash._inspector.rows) == 40  # task.num_test
    sess.close()


def test_report_from_a_live_session_and_from_the_run_directory(small_cfg, tmp_path):
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    summary = sess.run(steps=3, progress=False)
    dash = sess.dashboard()
    assert dash.facts()["state"] == "finished" and dash.facts()["target"] == 3  # a foreground run's true end
    page = dash.save(tmp_path / "live.html").read_text()
    assert "<h2>Summary" in page and "stopped before its end" not in page
    sess.step()
    assert dash.facts()["state"] == "ready"  # moved on since the run ended
    sess.close()
    assert page.count('class="plotly-graph-div"') == 4  # three sections and the phase timeline
    assert "Plotly.newPlot" in page and "<script src" not in page  # plotly.js inside: no network needed
    assert "held-out accuracy" in page and f"{summary['accuracy_after']:.3f}" in page
    first = json.loads((sess.run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()[0])
    assert first["prompt"] in page and "kl_coef" in page  # a rollout sample and the config
    # each step's samples have an anchor, linked from the heading, and the curves' clicks lead there
    assert all(f"<tr id='samples-step-{s}'>" in page and f"href='#samples-step-{s}'" in page for s in (1, 2, 3))
    assert "plotly_click" in page and page.count("class='rl-curves'") == 3
    assert cli(["report", str(sess.run_dir)]) == 0  # from the files alone, by default into the run directory
    offline = (sess.run_dir / "report.html").read_text()
    assert ">unfinished</b>" in offline  # a step was taken past the run's summary
    assert first["prompt"] in offline and offline.count('class="plotly-graph-div"') == 3
    assert cli(["report", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(rl.UsageError, match="not a run directory"):
        report_from_run_dir(tmp_path)


def test_report_of_a_stopped_run_with_odd_files(tmp_path):
    """A colleague's folder: a stopped background run, a NaN timing, a row whose step is not a number, a
    rollout file not named by a step. The report says what happened and renders the rest."""
    run = tmp_path / "odd"
    (run / "rollouts").mkdir(parents=True)
    rows = [{"step": s, "reward/mean": s / 4, "time/step_s": 0.5 if s > 1 else float("nan")} for s in (1, 2)]
    rows.append({"step": "<img src=x onerror=alert(1)>", "reward/mean": 1.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"steps": 2, "target": 10, "stopped": True, "wall_s": "?",
                                                  "accuracy_before": None, "accuracy_after": 0.5}))
    (run / "rollouts" / "step_000002.jsonl").write_text(json.dumps({"prompt": "<b>1+1=</b>", "response": "2"}) + "\n")
    (run / "rollouts" / "step_final.jsonl").write_text("{}\n")
    page = report_from_run_dir(run).read_text()
    assert ">stopped</b>" in page and "2 / 10" in page and "stopped before its end" in page
    assert "<img src=x" not in page and "&lt;b&gt;1+1=&lt;/b&gt;" in page


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
    saved = sess.inspect()  # the latest rollouts file, with its token ids: token views work from it too
    assert len(saved.rows) == 32
    assert "".join(t for t, _ in saved.token_colors(0)).startswith(saved.rows[0]["response"])


def test_background_failure_shows_in_the_dashboard_and_is_raised_next_time(small_cfg, monkeypatch):
    import asyncio
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    sess.save("start")
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
    assert "failed" in dash.header.value and "loss exploded" in dash.header.value
    with pytest.raises(RuntimeError, match="the background run failed at step 1: WorkerError: policy rank 0"):
        sess.run(steps=1, progress=False)
    monkeypatch.undo()
    # raised once; the update failed half-way, so the session asks for a resync (a run() once skipped that)
    with pytest.raises(rl.SessionStateError, match=r"cannot run: .* call sess.resync\(\)"):
        sess.run(steps=1, progress=False)
    sess.resync()
    assert sess.run(steps=1, progress=False)["steps"] == 1  # then the session carries on


def _episode_batch(tok):
    """Two samples as run_episodes leaves them, by hand: an episode (model "1+2*", environment "3=", model "3"
    EOS) and a direct answer ("7" EOS) right-padded to the episode's width."""
    import torch

    from rlbench_nb.data.batch import Batch
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    eos, pad = tok.eos_token_id, tok.pad_token_id
    episode = enc("1+2*") + enc("3=") + enc("3") + [eos]
    direct = enc("7") + [eos] + [pad] * 6
    return Batch({"response_ids_BR": torch.tensor([episode, direct]),
                  "response_mask_BR": torch.tensor([[1] * 8, [1, 1] + [0] * 6]),
                  "loss_mask_BR": torch.tensor([[1, 1, 1, 1, 0, 0, 1, 1], [1, 1] + [0] * 6]),
                  "rollout_logprobs_BR": torch.tensor([[-0.5, -0.25, -1.0, -2.0, 0.0, 0.0, -0.125, -0.75],
                                                       [-0.5, -1.5] + [0.0] * 6]),
                  "env_scores_B": torch.tensor([1.0, 0.0]), "num_turns_B": torch.tensor([2, 1]),
                  "tool_calls_B": torch.tensor([1, 0]), "tool_errors_B": torch.tensor([0, 0])},
                 {"prompt": ["1+2*3=", "3+4="], "response": ["1+2*3=3", "7"],
                  "env_error": ["", "<img src=x onerror=alert(1)>"]})


def test_inspector_shows_an_episode_turn_by_turn(tmp_path, monkeypatch):
    import torch

    from rlbench_nb.data.tasks.arithmetic import make_tokenizer
    from rlbench_nb.widgets.inspector import Inspector
    tok = make_tokenizer(tmp_path / "tok")
    batch = _episode_batch(tok)
    insp = Inspector(batch, tokenizer=tok)
    turns = insp.turns(0)
    assert [(s["who"], s["text"]) for s in turns] == [("model", "1+2*"), ("environment", "3="), ("model", "3")]
    assert [t for t, _ in turns[2]["tokens"]] == ["3", "<eos>"]  # EOS is the model's token, not its text
    assert [v for _, v in turns[1]["tokens"]] == [None, None]  # not trained on: no value, no colour
    assert [v for _, v in turns[0]["tokens"] + turns[2]["tokens"]] == [-0.5, -0.25, -1.0, -2.0, -0.125, -0.75]
    assert insp.turns(1) == [{"who": "model", "text": "7", "tokens": [("7", -0.5), ("<eos>", -1.5)]}]  # no padding
    advantages = torch.tensor([[0.5] * 4 + [9.0] * 2 + [0.5] * 2, [-0.25] * 8])
    by_adv = Inspector(batch.replace(advantages_BR=advantages), tokenizer=tok).turns(0, quantity="advantage")
    assert [v for s in by_adv for _, v in s["tokens"]] == [0.5] * 4 + [None] * 2 + [0.5] * 2

    page = insp.turns_html(0, "log-prob")
    assert "model, turn 1" in page and "model, turn 2" in page and "tool result" in page
    assert page.count("title='") == 6  # only the model's tokens are coloured
    assert "log-prob: -2.000 … -0.125" in page  # scaled over the model's tokens, not the environment's zeros
    assert "font-family:monospace;" in page and ">3=</div>" in page  # the environment's turn, as plain text
    assert "&lt;eos&gt;" in page and "<eos>" not in page
    assert "reward 1 · turns 2 · tool calls 1 · tool errors 0" in page and "env error" not in page
    assert "env error: &lt;img src=x" in insp.turns_html(1, "log-prob") and "<img" not in insp.turns_html(1, "log-prob")
    no_tools = Inspector(batch.replace(tool_calls_B=torch.tensor([0, 0])), tokenizer=tok).turns_html(0, "log-prob")
    assert ">environment</div>" in no_tools and "tool result" not in no_tools
    scored = Inspector(batch.replace(scores_B=torch.tensor([0.5, 0.0])), tokenizer=tok)
    assert "reward 0.5 · turns 2" in scored.turns_html(0, "log-prob")  # the scored reward, not the env's sum
    assert insp.token_pane_html(0, "log-prob") == page  # what the widget shows for an episode batch

    assert insp.columns[-2:] == ("turns", "tool_calls") and "<th>turns</th>" in insp.table_html()
    assert [r["index"] for r in insp.add_filter("turns", "==", "2").view()] == [0]
    single = Inspector(batch.only("response_ids_BR", "response_mask_BR", "rollout_logprobs_BR"), tokenizer=tok)
    assert "turns" not in single.columns
    (only,) = single.turns(0)  # no loss mask: the whole response is the model's
    assert only["who"] == "model" and only["text"] == "1+2*3=3"
    assert [v for _, v in only["tokens"]] == batch["rollout_logprobs_BR"][0].tolist()
    assert single.token_pane_html(0, "log-prob") == single.tokens_html(0, "log-prob")
    with pytest.raises(rl.UsageError, match="token views need a batch, or a rollouts file with token ids, and a"):
        Inspector(batch).turns(0)

    monkeypatch.setattr(tok, "decode", lambda ids, **_: "<script>alert(1)</script>" * len(ids))
    page = insp.turns_html(0, "log-prob")  # rollout content, the model's and the environment's, stays text
    mask = batch["response_mask_BR"][0].bool()
    env_tokens = int((batch["loss_mask_BR"][0][mask] == 0).sum())
    assert "<script>" not in page and page.count("&lt;script&gt;") == 6 + env_tokens  # every token, escaped


def test_token_pieces_join_into_the_text_with_multibyte_characters_whole(tmp_path):
    """A byte-level BPE (Qwen2's class, trained here on ASCII) splits ’, é, 日本 and an emoji into byte tokens
    that decode alone as U+FFFD: the token view gives each character to the token that completes it, and the
    pieces join into exactly the decoded response, however long."""
    from rlbench_nb.widgets.inspector import token_pieces

    from ..chat_model import make_chat_model
    make_chat_model(tmp_path / "m", ["the answer is 42", "Janet sells eggs at the market"] * 20)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    text = "Janet’s café: 日本 🙂 the answer is 42.\n\n#### 42<|im_end|>" * 12
    ids = tok(text, add_special_tokens=False)["input_ids"]
    singly = [tok.decode([t]) for t in ids]
    assert sum("\ufffd" in s for s in singly) > 12  # the characters really are split over tokens
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids) == text
    assert "\ufffd" not in "".join(pieces) and "🙂" in pieces and "’" in pieces
    assert token_pieces(tok, ids[:-1] + ids[-1:]) == pieces
    cut = ids[:next(i for i, s in enumerate(singly) if "\ufffd" in s) + 1]  # ends inside a character
    assert "".join(token_pieces(tok, cut)) == tok.decode(cut)


def test_a_rewards_parts_become_inspector_columns_but_never_replace_one():
    from rlbench_nb.widgets.inspector import _table_row
    row = _table_row(3, {"prompt": "p", "reward": 1.2, "reward_parts": {"index": 9.0, "reward": 0.0, "short": 1.0}})
    assert row["index"] == 3 and row["reward"] == 1.2 and row["short"] == 1.0
