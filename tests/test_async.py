"""Bounded staleness: `run(async_rollout=True, max_staleness=k)` keeps up to k rollouts generating ahead of the
step being trained (local backend here; tests/cluster/test_ray_backend.py overlaps them under Ray)."""
from __future__ import annotations

import pytest

import rlbench_nb as rl
from rlbench_nb.errors import UsageError

VOLATILE = ("time/", "throughput/", "memory/", "async/")  # wall-clock facts, not the run's numbers
SECONDS = ("_s", "/s")  # sync/s, sync/verify_s: wall-clock too


def _numbers(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not (k.startswith(VOLATILE) or k.endswith(SECONDS))} for row in history]


def _head(model) -> float:
    """A fingerprint of a model's weights: the sum of its LM head."""
    return model.get_output_embeddings().weight.double().sum().item()


def test_max_staleness_zero_is_the_synchronous_loop(small_cfg):
    cfg = ["run.tensorboard=false", "run.eval_every=0", "train.lr=1e-2"]
    sync = rl.Session(small_cfg(*cfg))
    sync.run(4, progress=False)
    zero = rl.Session(small_cfg(*cfg))
    zero.run(4, progress=False, async_rollout=True, max_staleness=0)
    assert _numbers(zero.history) == _numbers(sync.history)  # bit for bit
    assert not any(k.startswith("async/") for row in zero.history for k in row)
    sync.close()
    zero.close()


@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_is_trained_at_most_k_steps_after_the_weights_that_generated_it(small_cfg, k, monkeypatch):
    sess = rl.Session(small_cfg("run.tensorboard=false", "run.eval_every=0", "train.lr=1e-2"))
    engine, policy = sess.groups["rollout"].workers[0], sess.groups["policy"].workers[0]
    generated_with, generate = [], engine.generate  # the engine's weights at each training draw

    def recording(batch, params=None):
        if params is None:  # not an evaluation's greedy pass
            generated_with.append(_head(engine.model))
        return generate(batch, params)
    monkeypatch.setattr(engine, "generate", recording)
    versions = [_head(policy.model)]  # the policy's weights after 0, 1, 2, ... updates
    sess.on_step(lambda row: versions.append(_head(policy.model)) if row else None)
    sess.run(5, progress=False, async_rollout=True, max_staleness=k)
    staleness = [row["async/staleness"] for row in sess.history]
    assert staleness == [min(s, k) for s in range(5)]  # the first batches are as stale as there were updates
    assert len(set(versions)) == 6  # every update moved the weights (lr 1e-2)
    # the batch trained at step s came from the weights of `staleness` updates before the trainer's
    assert generated_with == [versions[s - int(staleness[s])] for s in range(5)]
    for row in sess.history:
        assert 0.0 <= row["async/rollout_idle"] <= 1.0 and 0.0 <= row["async/trainer_idle"] <= 1.0
    assert sess.progress.sampler.state_dict() == _sync_sampler_after(small_cfg, 5)  # every prompt once, in order
    sess.close()


def test_an_interrupted_async_step_gives_its_prompts_and_the_queued_ones_back(small_cfg, monkeypatch):
    sess = rl.Session(small_cfg("run.tensorboard=false", "run.eval_every=0"))
    calls, score = [], sess.score

    def score_then_interrupt(batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return score(batch)
    monkeypatch.setattr(sess, "score", score_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        sess.run(6, progress=False, async_rollout=True, max_staleness=2)
    assert sess.step_count == 2
    # step 3's batch and the two queued behind it were drawn, then given back: the next step draws step 3's
    assert sess.progress.sampler.state_dict() == _sync_sampler_after(small_cfg, 2)
    sess.close()


def test_max_staleness_must_be_a_whole_number(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    for bad in (-1, 1.5, True):
        with pytest.raises(UsageError, match="max_staleness"):
            sess.run(1, progress=False, async_rollout=True, max_staleness=bad)
    sess.close()


def _sync_sampler_after(small_cfg, steps: int) -> dict:
    """Where the data order stands after `steps` synchronous steps (the sampler alone: no model needed)."""
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    for _ in range(steps):
        sess.progress.sampler.next_indices()
    state = sess.progress.sampler.state_dict()
    sess.close()
    return state


def test_close_during_a_background_run_ends_it_stopped_at_a_step_boundary(small_cfg):
    """close() while a background run steps the session waits for the step under way, so the run ends
    "stopped" with every finished step recorded (it ended "failed: cannot evaluate" when the workers closed
    under it); a run() after close() says the session is closed, not that another session took it over."""
    import asyncio

    sess = rl.Session(small_cfg("run.tensorboard=false", "run.eval_every=0"))

    async def close_mid_run():
        run = sess.run(steps=500, background=True)
        while sess.step_count < 2:
            await asyncio.sleep(0.02)
        sess.close()
        await run
        return run

    run = asyncio.run(close_mid_run())
    assert run.state == "stopped" and run.error is None and sess.state == "closed"
    assert 2 <= sess.step_count < 500 and [r["step"] for r in sess.history] == list(range(1, sess.step_count + 1))
    with pytest.raises(rl.SessionStateError, match="cannot run: the session is closed"):
        sess.run(steps=1)

    sess = rl.Session(small_cfg("run.tensorboard=false"))

    async def close_at_once():  # in the same cell as the start: the loop never begins
        run = sess.run(steps=5, background=True)
        sess.close()
        await run
        return run

    run = asyncio.run(close_at_once())
    assert run.state == "stopped" and sess.step_count == 0
