"""`sess.compare`'s table (widgets/comparison.py) on runs written out by hand: pure logic, so the runs are plain
objects with a name and metric rows, as a Branch holds them."""
import pytest

from rlbench_nb.branches import Branch
from rlbench_nb.errors import UsageError
from rlbench_nb.widgets.comparison import Comparison


class Run:
    def __init__(self, name, history, evals=()):
        self.name, self.history, self.evals = name, list(history), list(evals)

    curve = Branch.curve  # the branch's own reading of its rows


def test_the_table_is_the_mean_of_the_last_steps_and_the_difference_from_the_first_run():
    a = Run("a", [{"step": s, "reward/mean": r} for s, r in ((1, 0.0), (2, 0.2), (3, 0.4))],
            [{"step": 3, "eval/accuracy": 0.5}])
    b = Run("b", [{"step": s, "reward/mean": r, "kl/ref": 0.1} for s, r in ((1, 0.5), (2, 0.7), (3, 0.9))],
            [{"step": 0, "eval/accuracy": 0.1}, {"step": 3, "eval/accuracy": 0.75}])
    rows = {r["metric"]: r for r in Comparison([a, b], last=2).table()}
    # defaults that no run has (loss/policy, entropy, ...) are left out; one run's metric is shown, the other's None
    assert list(rows) == ["reward/mean", "eval/accuracy", "kl/ref"]
    assert rows["reward/mean"]["a"] == pytest.approx(0.3) and rows["reward/mean"]["b"] == pytest.approx(0.8)
    assert rows["reward/mean"]["Δ b"] == pytest.approx(0.5)
    assert rows["eval/accuracy"]["b"] == 0.75 and rows["eval/accuracy"]["Δ b"] == pytest.approx(0.25)  # last eval
    assert rows["kl/ref"]["a"] is None and rows["kl/ref"]["Δ b"] is None


def test_a_metric_asked_for_by_name_that_no_run_has_is_said_with_the_nearest():
    a = Run("a", [{"step": 1, "reward/mean": 0.1}])
    with pytest.raises(UsageError, match=r"no run to compare has metric 'reward/mena' \(did you mean 'reward/mean'\?\)"
                                         r"; they have: reward/mean$"):
        Comparison([a, Run("b", [{"step": 1, "reward/mean": 0.2}])], metrics=["reward/mean", "reward/mena"])
    # one name as a string; a real metric with no value yet (no evaluation) is left out, as the defaults are
    assert [r["metric"] for r in Comparison([a], metrics="reward/mean").table()] == ["reward/mean"]
    assert Comparison([a], metrics=["reward/mean", "eval/accuracy"]).metrics == ["reward/mean"]
    with pytest.raises(UsageError, match=r"no run to compare has any of \['kl/ref'\]; they have: reward/mean$"):
        Comparison([a], metrics=["kl/ref"])
    with pytest.raises(UsageError, match="runs to compare need distinct names"):
        Comparison([a, a])
    with pytest.raises(UsageError, match="sess.compare takes branches .* got str"):
        Comparison([a, "b"])
