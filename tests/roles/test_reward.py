import math

import pytest

from rlbench_nb.data.batch import Batch
from rlbench_nb.roles.reward import RewardWorker, load_reward_fn


def batch():
    return Batch(meta={"prompt": ["1+1=", "2+2=", "3+3=", "4+4=", "5+5="],
                       "response": ["2", "4", "7", "8", "10"], "answer": ["2", "4", "6", "8", "10"],
                       "group": ["a"] * 5, "advantage": [0.0] * 5},  # a field added by prepare(): not passed on
                 info={"row_fields": ["answer"]})


def picky(prompt, response, answer):
    if prompt == "2+2=":
        raise ZeroDivisionError("boom")
    if prompt == "3+3=":
        return math.nan
    if prompt == "4+4=":
        return None
    if prompt == "5+5=":
        return "1.0"
    return float(response == answer)


def test_bad_samples_score_zero_with_the_error_and_the_rest_scores():
    out = RewardWorker(picky).score(batch())
    assert out["scores_B"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    err = out["reward_error"]
    assert err[0] is None
    assert err[1] == "reward function 'picky' ZeroDivisionError on sample 1 (prompt '2+2='): boom"
    assert "ValueError" in err[2] and "returned nan" in err[2]
    assert "returned NoneType None, expected a float" in err[3]
    assert "returned str '1.0'" in err[4]


def test_row_fields_reach_the_function_and_swap():
    seen = []
    w = RewardWorker(lambda prompt, response, answer: seen.append(answer) or 0.5)
    assert w.score(batch())["scores_B"].tolist() == [0.5] * 5 and seen == ["2", "4", "6", "8", "10"]
    w.set_fn(lambda prompt, response, **kw: len(response))
    assert w.score(batch())["scores_B"].tolist() == [1, 1, 1, 1, 2]


def test_load_reward_fn_from_file_and_errors(tmp_path):
    f = tmp_path / "rew.py"
    f.write_text("def exact(prompt, response, answer):\n    return float(response == answer)\n")
    assert load_reward_fn(f"{f}:exact")("", "1", "1") == 1.0
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_reward_fn(f"{f}:nope")
    with pytest.raises(ValueError, match="must be 'task', 'module:function'"):
        load_reward_fn("justaname")
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/missing.py:f")


def test_a_hanging_call_is_cut_and_the_rest_still_score():
    import threading
    import time
    release = threading.Event()

    def sometimes_hangs(prompt, response, answer):
        if prompt == "3+3=":
            release.wait(30)  # hangs (until the test lets it go)
        return float(response == answer)

    w = RewardWorker(sometimes_hangs, timeout_s=0.3)
    t = time.perf_counter()
    out = w.score(batch())
    assert time.perf_counter() - t < 3
    assert out["scores_B"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]  # after the hang a fresh thread scores on
    assert "TimeoutError on sample 2" in out["reward_error"][2] and "reward.timeout_s=0.3s" in out["reward_error"][2]
    assert w.score(batch())["reward_error"][2] is not None  # and again next step, without waiting twice as long
    release.set()
