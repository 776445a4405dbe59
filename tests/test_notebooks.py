"""The shipped notebooks, executed top to bottom in a real kernel (nbclient), with their outputs checked (the cluster
notebook on a `ray start --head` cluster: tests/cluster/test_ray_head.py)."""
import re

import nbformat
import pytest
from nbclient import NotebookClient

from .conftest import REPO, SMALL

pytestmark = pytest.mark.integration  # the second stage: see pyproject.toml's markers


def execute(name: str, params: str) -> str:
    """Run notebooks/<name> with `params` injected after its parameters cell (as papermill does)."""
    nb = nbformat.read(str(REPO / "notebooks" / name), as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(params))
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()  # cwd notebooks/, as in Lab
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stdout")


# Cost ~11 s: notebook 02 in a kernel; the only run of the reward-shaping journey.
def test_inspect_and_shape_rewards(tmp_path):
    text = execute("02_inspect_and_shape_rewards.ipynb",
                   f"steps = 3\nrun_dir = {str(tmp_path)!r}\noverrides = {[*SMALL, 'run.tensorboard=false']!r}")
    wrong, total = map(int, re.search(r"(\d+) of (\d+) samples are wrong", text).groups())
    assert total == 32 and 0 < wrong < total
    before, after = map(float, re.search(r"exact ([\d.]+) -> shaped ([\d.]+)", text).groups())
    assert after >= before  # partial credit can only add reward on the same responses
    assert "with the shaped reward" in text


# Cost ~19 s: notebook 04 in a kernel with its asserted outputs (the replays differ); the only run of the what-if
# journey.
def test_what_if_notebook_replays_forks_compares_and_keeps_one(tmp_path):
    text = execute("04_what_if.ipynb", f"steps = 2\nbranch_steps = 2\nrun_dir = {str(tmp_path)!r}\n"
                                       f"overrides = {[*SMALL, 'run.tensorboard=false', 'task.num_test=16']!r}")
    assert re.search(r"main line: step 2, held-out accuracy [\d.]+", text)
    assert re.search(r"\d+ of 32 samples will be pushed down", text)
    found = re.findall(r"(clip-0\.1|clip-0\.28|clipped-reinforce): clipped ([\d.]+|nan) of tokens, largest relative "
                       r"weight change (\d\.\d\de-\d\d) in model\.", text)
    replays = {name: (float(clipped), change) for name, clipped, change in found}
    assert set(replays) == {"clip-0.1", "clip-0.28", "clipped-reinforce"}
    # the settings act: past the first mini-batch the ratio leaves 1, the tighter range clips more, and the three
    # updates move the weights differently (one mini-batch on-policy gave three identical rows)
    assert replays["clip-0.1"][0] > replays["clip-0.28"][0]
    assert len({change for _, change in replays.values()}) == 3
    assert "still at step 2" in text  # three replays, and the session is where it was
    assert re.search(r"loss/policy\s+[-\d.e]+\s+[-\d.e]+\s+[-\d.e]+", text)  # the comparison table's row
    kept = re.search(r"kept (lr-5e-5|lr-4e-4): step 4, held-out accuracy [\d.]+, lr (5e-05|0.0004)", text)
    assert kept and {"lr-5e-5": "5e-05", "lr-4e-4": "0.0004"}[kept.group(1)] == kept.group(2)
    assert (tmp_path / "branches" / "lr-5e-5" / "metrics.jsonl").exists()


# Cost ~25 s: notebook 07 in a kernel: a Tinker server on the session, the SDK's loop, the dashboard, a fork.
def test_tinker_notebook_drives_the_session_with_the_sdk_then_inspects_and_forks(tmp_path):
    text = execute("07_tinker_api.ipynb", f"steps = 3\nfork_steps = 2\nrun_dir = {str(tmp_path)!r}\n"
                                          f"overrides = {[*SMALL, 'run.tensorboard=false', 'task.num_test=16']!r}")
    assert len(re.findall(r"step \d: reward [\d.]+, \d+ datums", text)) == 3
    assert "the session took 3 steps" in text        # each optim_step was one of the session's steps
    assert re.search(r"the client's last sample: '\d+[+\-*]\d+=' -> ", text)
    assert re.search(r"fork grpo-lr-1e-4: 2 steps of the session's GRPO from step 3; reward [\d.]+ -> [\d.]+; "
                     r"the session is back at step 3", text)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow  # the tool task's warm start (~30 s, shared with the other tool tests) and 20 steps
def test_tools_notebook_finds_the_broken_tool_fixes_it_and_trains(tmp_path):
    text = execute("05_tools.ipynb", f"steps = 20\nrun_dir = {str(tmp_path)!r}\n"
                                     f"overrides = {['run.tensorboard=false', 'task.num_test=200']!r}")
    called, total, wrong = map(int, re.search(r"(\d+) of (\d+) episodes called the tool; (\d+) of them scored 0",
                                              text).groups())
    assert total == 128 and 0 < called == wrong  # the tool subtracts: every episode that trusted it is wrong
    assert re.search(r"      model: <call>\d+\+\d+</call>\nenvironment: <result>-?\d+</result>\n      model: -?\d+",
                     text)  # the episode turn by turn: the call, the tool's (wrong) result, the copied answer
    right, fixed_calls = map(int, re.search(r"after the fix: (\d+) of (\d+) episodes", text).groups())
    assert right >= 0.7 * fixed_calls > 0
    m = re.search(r"held-out accuracy ([\d.]+) -> ([\d.]+); greedy episodes calling the tool ([\d.]+) -> ([\d.]+)",
                  text)
    before, after, use_before, use_after = map(float, m.groups())
    assert after >= before + 0.15 and use_after > use_before
