import math

import pytest
import torch

from rlbench_nb.config import RewardConfig
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


def test_a_reward_float32_cannot_hold_is_named_at_scoring_time():
    """1e39 is a valid Python float but inf in the float32 batch: the step would be skipped later as a
    "non-finite loss", far from its cause. The sample scores 0 and its error names the value."""
    out = RewardWorker(lambda prompt, response, answer: 1e39 if prompt == "2+2=" else -3.0e38).score(batch())
    assert out["scores_B"].tolist() == pytest.approx([-3.0e38, 0.0, -3.0e38, -3.0e38, -3.0e38])
    assert torch.isfinite(out["scores_B"]).all()
    assert "returned 1e+39, beyond float32's range" in out["reward_error"][1] and "sample 1" in out["reward_error"][1]


def test_bad_samples_score_zero_with_the_error_and_the_rest_scores():
    out = RewardWorker(picky).score(batch())
    assert out["scores_B"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    err = out["reward_error"]
    assert err[0] is None
    assert err[1] == "reward function 'picky' ZeroDivisionError on sample 1 (prompt '2+2='): boom"
    assert "ValueError" in err[2] and "returned nan" in err[2]
    assert "returned NoneType None, expected a float" in err[3]
    assert "returned str '1.0'" in err[4]


def parts_of_answer(prompt, response, answer):
    from rlbench_nb.rewards import Scored
    if prompt == "1+1=":
        return Scored(1.0, {"right": float("nan")})  # a part that is no number fails its sample
    return Scored(float(response == answer) + 0.5, {"right": float(response == answer), "short": 1.0})


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_reward_with_parts_keeps_them_per_sample_and_the_metrics_average_each(isolation):
    from rlbench_nb.metrics.compute import reward_metrics
    w = RewardWorker(parts_of_answer, RewardConfig(isolation=isolation, processes=1))
    try:
        out = w.score(batch())
    finally:
        w.close()
    assert out["scores_B"].tolist() == [0.0, 1.5, 0.5, 1.5, 1.5]
    parts = out["reward_parts"]
    assert parts[1] == {"right": 1.0, "short": 1.0} and parts[2] == {"right": 0.0, "short": 1.0}
    assert parts[0] is None and "part 'right' returned nan" in out["reward_error"][0]
    m = reward_metrics(out)  # over the four samples that have parts
    assert m["reward/part/right"] == pytest.approx(0.75) and m["reward/part/short"] == 1.0
    plain = RewardWorker(lambda prompt, response, answer: 1.0).score(batch())
    assert plain["reward_parts"] == [None] * 5 and not any("/part/" in k for k in reward_metrics(plain))


def test_row_fields_reach_the_function_and_swap():
    seen = []
    w = RewardWorker(lambda prompt, response, answer: seen.append(answer) or 0.5)
    # every row's own field (calls run concurrently: in any order)
    assert w.score(batch())["scores_B"].tolist() == [0.5] * 5 and sorted(seen) == ["10", "2", "4", "6", "8"]
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

    w = RewardWorker(sometimes_hangs, RewardConfig(timeout_s=0.3))
    t = time.perf_counter()
    out = w.score(batch())
    assert time.perf_counter() - t < 3
    assert out["scores_B"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]  # after the hang a fresh thread scores on
    assert "TimeoutError on sample 2" in out["reward_error"][2] and "reward.timeout_s=0.3s" in out["reward_error"][2]
    assert w.score(batch())["reward_error"][2] is not None  # and again next step, without waiting twice as long
    release.set()


def _calls(n: int) -> Batch:
    return Batch(meta={"prompt": [f"{i}+0=" for i in range(n)], "response": [str(i) for i in range(n)],
                       "answer": [str(i) for i in range(n)]}, info={"row_fields": ["answer"]})


def test_what_kills_a_process_costs_only_its_sample_under_process_isolation(tmp_path):
    import os as _os
    cwd = _os.getcwd()

    def hostile(prompt, response, answer):
        import ctypes
        import os
        import sys
        if prompt == "1+0=":
            sys.exit(3)
        if prompt == "2+0=":
            os._exit(1)
        if prompt == "3+0=":
            ctypes.string_at(0)  # segfault
        if prompt == "4+0=":
            bytearray(3 * 2**30)  # past reward.max_memory_gb
        if prompt == "5+0=":
            os.chdir("/")
        if prompt == "6+0=":
            import time
            time.sleep(60)  # hangs: killed at the deadline
        return float(response == answer) + (0.5 if os.getcwd() == "/" else 0.0)

    w = RewardWorker(hostile, RewardConfig(isolation="process", timeout_s=5, max_memory_gb=1.5, processes=2))
    try:
        out = w.score(_calls(10))
        scores, errors = out["scores_B"].tolist(), out["reward_error"]
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.5, 0.0, 1.0, 1.0, 1.0]  # only 5 itself ran in "/"
        assert "SystemExit on sample 1" in errors[1] and "ProcessDied on sample 2" in errors[2]
        assert "ProcessDied on sample 3" in errors[3] and "MemoryError on sample 4" in errors[4]
        assert "TimeoutError on sample 6" in errors[6]
        assert [e is None for e in errors] == [True, False, False, False, False, True, False, True, True, True]
        assert _os.getcwd() == cwd
        again = w.score(_calls(2))  # the pool replaced what died and goes on
        assert again["scores_B"].tolist() == [1.0, 0.0] and "SystemExit" in again["reward_error"][1]
    finally:
        w.close()


HELD = []


def holds_memory(prompt, response, answer):
    """Keeps 400 MB resident in the reward process that runs it (touched, so the pages are real)."""
    if not HELD:
        HELD.append(bytearray(b"x") * (400 * 2**20))
    return float(response == answer)


def test_the_reward_memory_metric_counts_its_isolation_processes():
    """memory/reward_peak_gb read 0.44 GB while the isolated reward processes held 2 GB: the pool's processes
    are the role's memory too. Each of the 2 processes keeps 400 MB, so the role's figures grow by >= 0.7 GB
    over this process's own (a margin for the page size and what the interpreter frees)."""
    w = RewardWorker(holds_memory, RewardConfig(isolation="process", processes=2))
    try:
        own = w.memory()
        w.score(_calls(4))
        with_pool = w.memory()
        assert with_pool["rss_gb"] - own["rss_gb"] > 0.7
        assert with_pool["peak_rss_gb"] - own["peak_rss_gb"] > 0.7
    finally:
        w.close()
    assert w.memory()["rss_gb"] - own["rss_gb"] < 0.3  # closed: the pool's memory is gone with it


def test_a_batch_of_hung_calls_costs_one_timeout_and_process_mode_leaves_no_thread_behind():
    import threading
    import time

    def hangs(prompt, response, answer):
        import time
        time.sleep(60)

    for isolation in ("thread", "process"):
        w = RewardWorker(hangs, RewardConfig(isolation=isolation, timeout_s=1.0, concurrency=16))
        threads = threading.active_count()
        t0 = time.perf_counter()
        out = w.score(_calls(16))
        assert time.perf_counter() - t0 < 4, isolation  # one deadline for the batch, not 16 x 1 s
        assert all("TimeoutError" in e for e in out["reward_error"])
        if isolation == "process":
            assert threading.active_count() == threads  # the hung calls died with their process
        w.close()


def test_cheap_calls_share_one_thread_and_slow_ones_spread_to_full_concurrency(monkeypatch):
    """Threads start as calls wait (one more per GROW_S of waiting): a batch the first thread finishes in time
    runs on it alone (starting eight cost ~6 ms a step, more than the calls), a slow one still runs 8 at a time."""
    import threading
    import time

    from rlbench_nb import isolation

    seen = set()

    def cheap(prompt, response, answer):
        seen.add(threading.get_ident())
        return 1.0

    with monkeypatch.context() as m:
        m.setattr(isolation, "GROW_S", 5.0)  # time enough for 64 cheap calls on any machine, however busy
        w = RewardWorker(cheap, RewardConfig(isolation="thread", concurrency=8))
        assert w.score(_calls(64))["scores_B"].tolist() == [1.0] * 64
    assert len(seen) == 1

    def slow(prompt, response, answer):
        seen.add(threading.get_ident())
        time.sleep(0.3)
        return 1.0

    seen.clear()
    w = RewardWorker(slow, RewardConfig(isolation="thread", concurrency=8))
    t0 = time.perf_counter()
    assert w.score(_calls(16))["scores_B"].tolist() == [1.0] * 16
    assert time.perf_counter() - t0 < 1.5 and len(seen) == 8  # two rounds of 8 (0.6 s), not 16 x 0.3 s


def test_numbers_of_every_kind_are_rewards_and_async_rewards_run_together():
    import time

    import numpy as np

    values = [True, np.bool_(False), np.float32(0.25), np.int64(2), torch.tensor(0.5), torch.tensor([1.5])]
    w = RewardWorker(lambda prompt, response, answer: values[int(response)])
    assert w.score(_calls(6))["scores_B"].tolist() == [1.0, 0.0, 0.25, 2.0, 0.5, 1.5]

    async def slow(prompt, response, answer):
        import asyncio
        await asyncio.sleep(0.5)
        return float(response == answer)

    for isolation in ("thread", "process"):
        w = RewardWorker(slow, RewardConfig(isolation=isolation))
        t0 = time.perf_counter()
        out = w.score(_calls(20))
        assert out["scores_B"].tolist() == [1.0] * 20 and time.perf_counter() - t0 < 4  # awaited together
        w.close()


def test_auto_isolation_runs_your_functions_in_processes_under_the_local_backend():
    from rlbench_nb.data.tasks.arithmetic import verify
    assert RewardWorker(verify, RewardConfig(), local_backend=True).isolation == "thread"  # the package's own
    assert RewardWorker(picky, RewardConfig(), local_backend=True).isolation == "process"
    assert RewardWorker(picky, RewardConfig(), local_backend=False).isolation == "thread"  # a Ray actor already
