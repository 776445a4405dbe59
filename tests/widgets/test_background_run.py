"""A background run in a real kernel (nbclient): the kernel stays free, the dashboard keeps updating
while another cell executes, and pause / resume / stop act at step boundaries."""
import nbformat
import pytest
from nbclient import NotebookClient

from ..conftest import REPO, SMALL

pytestmark = pytest.mark.integration  # the second stage: see pyproject.toml's markers


# Cost ~24 s: a real kernel, so the background thread, the free kernel and the dashboard's updates are the kernel's,
# not pytest's.
def test_background_run_in_a_kernel(tmp_path):
    overrides = [*SMALL, f"run.dir={tmp_path}", "run.tensorboard=false", "data.batch_size=4", "rollout.n=2",
                 "task.num_test=20"]
    cells = [
        "import asyncio, time, rlbench_nb as rl\n"
        f"sess = rl.Session(rl.Config.load(None, {overrides!r}))\n"
        "dash = sess.dashboard(); dash.min_interval_s = 0.0\ndash",
        "run = sess.run(steps=200, background=True)\nprint('started', run.state)",
        # a busy, synchronous cell: the run goes on in its thread and the dashboard keeps redrawing
        "s0, r0 = sess.step_count, dash.redraws\ntime.sleep(4)\nprint('during', s0, sess.step_count, r0, dash.redraws)",
        "sess.pause()\nawait asyncio.sleep(1.0)\ns1 = sess.step_count\nawait asyncio.sleep(1.5)\n"
        "print('paused', run.state, s1, sess.step_count)",
        "sess.resume()\nawait asyncio.sleep(1.0)\nsess.stop()\nsummary = await run\n"
        "print('stopped', run.state, summary['steps'], sess.step_count, len(sess.history), "
        "'>stopped</b>' in dash.header.value)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    out = {c.source.split("\n")[0]: "".join(o.get("text", "") for o in c.outputs) for c in nb.cells}
    text = "\n".join(out.values())
    assert "started running" in text
    during = next(line for line in text.splitlines() if line.startswith("during")).split()
    s0, s1, r0, r1 = map(int, during[1:])
    assert s1 > s0 and r1 > r0, f"no progress while another cell ran: {during}"
    paused = next(line for line in text.splitlines() if line.startswith("paused")).split()
    assert paused[1] == "paused" and paused[2] == paused[3], f"steps advanced while paused: {paused}"
    stopped = next(line for line in text.splitlines() if line.startswith("stopped")).split()
    assert stopped[1] == "stopped" and int(stopped[2]) < 200
    assert int(stopped[2]) == int(stopped[3]) == int(stopped[4])  # every finished step is in the history
    assert stopped[5] == "True", "the dashboard's header does not say the run stopped"  # its last redraw came
    # from inside the ending task: it said "running" for good before BackgroundRun knew it had ended
