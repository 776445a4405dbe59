"""What each phase asks of which workers: the calls behind `Session.rollout`, `score`, `prepare`, `update`
and `evaluate`. Session keeps the order of the phases and the state they move (progress.py, its `state`);
these functions fan a batch out to the roles (side by side where the backend can), gather what comes back
and return a new batch with the phase's metrics in `info["metrics"]`.

    started = start_rollout(workers, prompt_batch, cfg, env_cls, draw)  # the engines generate ...
    batch = collect_rollout(workers, prompts, started, step, max_new)  # ... and the batch comes back decoded
    batch = score(workers, batch, epoch)                                # rewards (+ the critic's values)
    batch = prepare(workers, batch, cfg, kl_coef=..., epoch=..., reuse=reuses_logprobs(cfg, workers, step))
    trainer_steps, moved, push = train(workers, batch, cfg.train, step, kl_coef, metrics)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .algos.prepare import advantages_for
from .cluster.base import Pending, WorkerGroup, finish_all
from .cluster.workers import Workers
from .data.batch import Batch, minibatch_major
from .determinism import sample_seeds
from .errors import UsageError, expect, is_count
from .metrics import compute
from .prompts import PromptCodec, generate_inputs, reward_inputs
from .roles import CriticWorker, PolicyWorker, ReferenceWorker, RewardModelWorker, RewardWorker
from .roles.rollout.base import RolloutWorker

log = logging.getLogger(__name__)


@dataclass
class StartedRollout:
    """A rollout submitted to the engines, not collected yet (`Session.start_rollout`)."""
    batch: Batch      # the encoded prompts, rollout.n rows each
    pending: Pending  # the engines' calls
    t0: float         # when it was submitted: the rollout's seconds count from here


def start_rollout(workers: Workers, batch: Batch, cfg, env_cls, draw: tuple) -> StartedRollout:
    """Submit the encoded `batch` to the rollout ranks: single responses, or with `env_cls` one episode per
    row. `draw` names the prompts drawn (run.deterministic seeds each sample from it, not the engine's RNG)."""
    rollout = workers.groups["rollout"]
    if env_cls is not None:  # episodes: each env instance starts from its data row
        t0 = time.perf_counter()
        rows_in = batch.only("prompt", *batch.info.get("row_fields", ()))
        return StartedRollout(batch, rollout.submit_shards(RolloutWorker.generate_episodes, rows_in, env_cls), t0)
    inputs = generate_inputs(batch)
    if cfg.run.deterministic:  # determinism.py: sampling seeded per draw
        inputs["sample_seed_B"] = sample_seeds(cfg.run.seed, draw, len(batch))
    t0 = time.perf_counter()  # before submitting: the local backend does the work inside submit_shards
    return StartedRollout(batch, rollout.submit_shards(RolloutWorker.generate, inputs), t0)


def collect_rollout(workers: Workers, prompts: PromptCodec, started: StartedRollout, step: int,
                    max_new_tokens: int) -> Batch:
    """The engines' responses joined onto the prompts, decoded, with the rollout's metrics in `info`."""
    rollout = workers.groups["rollout"]
    batch = started.batch
    parts = rollout.collect(started.pending)
    if parts and "loss_mask_BR" in parts[0]:  # episodes: the environments' own prompts, several widths
        from .roles.rollout.episodes import cat_episodes
        batch = batch.replace(cat_episodes(parts, prompts.tokenizer.pad_token_id))
    else:
        batch = batch.replace(Batch.cat(parts))
    seconds = time.perf_counter() - started.t0
    if workers.rollout_sleeps():  # give the accelerator to the trainers until the next weight sync
        rollout.call(RolloutWorker.sleep)
    batch = prompts.decode(batch)
    batch.info.update(step=step, metrics=compute.rollout_metrics(batch, seconds, max_new_tokens))
    return batch


def discard_rollout(workers: Workers, started: StartedRollout) -> None:
    """Wait for a started rollout nobody will use (so its worker is free), ignoring its failure."""
    try:
        workers.groups["rollout"].collect(started.pending)
    except Exception:
        pass


def rewards(workers: Workers, inputs: Batch, batch: Batch) -> Batch:
    """The rule function's scores, and with a reward model its scores too, computed at the same time on
    their own workers and combined by weight (reward.rule_weight, reward.model.weight). Episodes (env.fn)
    carry their environment's rewards: those are the scores."""
    if "env_scores_B" in batch:
        return Batch({"scores_B": batch["env_scores_B"].float()},
                     {"reward_error": [""] * len(batch), "reward_parts": [None] * len(batch)})
    rule = workers.groups["reward"]
    if "reward_model" not in workers:
        return rule.call_split(RewardWorker.score, inputs)
    rm = workers.groups["reward_model"]
    model_call = (rm, rm.submit_shards(RewardModelWorker.score, inputs))
    scored, (model,) = finish_all(lambda: rule.call_split(RewardWorker.score, inputs), model_call)
    model = Batch.cat(model)
    w = workers.cfg.reward
    scored["rule_scores_B"], scored["rm_scores_B"] = scored["scores_B"], model["rm_scores_B"]
    scored["scores_B"] = w.rule_weight * scored["scores_B"] + w.model.weight * model["rm_scores_B"]
    return scored


def scored_batch(batch: Batch, scored: Batch) -> Batch:
    """`batch` with the rewards of `scored`: re-scoring keeps the earlier reward beside the new one
    (`scores_before_B`) and drops what was derived from it (advantages: prepare again); `reward_parts` only
    where the reward has parts (a `Scored`, e.g. `combine`'s), never an earlier function's."""
    out = batch.replace(scored)
    if "scores_B" in batch:
        out["scores_before_B"] = batch["scores_B"]
    for stale in ("advantages_BR", "returns_BR", "advantage"):
        out.tensors.pop(stale, None)
        out.meta.pop(stale, None)
    if all(p is None for p in out.meta.get("reward_parts", ())):
        out.meta.pop("reward_parts", None)
    return out


def score(workers: Workers, batch: Batch, epoch: int) -> Batch:
    """`batch` with its rewards and their metrics; with a critic, its values computed beside the rewards on
    the critic's own workers (the seed's PPO: critic and reward model score in parallel), kept with the
    weights' `epoch` so prepare reuses them while the weights are the same."""
    expect(batch, Batch, "sess.score(batch)", "a batch from sess.rollout()")
    m = dict(batch.info.get("metrics", {}))
    with compute.timed(m, "time/score_s"):
        values_call = None if has_current_values(batch, epoch) else start_values(workers, batch)
        scored, (values,) = finish_all(lambda: rewards(workers, reward_inputs(batch), batch), values_call)
    out = scored_batch(batch, scored)
    if values is not None:
        out["values_BR"] = Batch.cat(values)["values_BR"]
        out.info["values_epoch"] = epoch
    m.update(compute.reward_metrics(out))
    out.info["metrics"] = m
    if m["reward/errors"]:
        first = next(e for e in out["reward_error"] if e)
        log.warning("%d reward error(s) this step; first: %s", m["reward/errors"], first)
    return out


def has_current_values(batch: Batch, epoch: int) -> bool:
    """The batch's critic values were computed on the weights of `epoch` (guard.py's count of changes)."""
    return "values_BR" in batch and batch.info.get("values_epoch") == epoch


def prepare(workers: Workers, batch: Batch, cfg, *, kl_coef: float, epoch: int, reuse: bool) -> Batch:
    """Old log-probs (policy), reference log-probs and KL, values (critic), advantages and returns, with
    prepare's metrics. `reuse`: the old log-probs come from the update's own forward (reuses_logprobs)."""
    expect(batch, Batch, "sess.prepare(batch)", "a batch from sess.score(...)")
    if "scores_B" not in batch:
        raise UsageError("prepare(batch) needs a scored batch (its advantages come from the rewards): "
                         "sess.prepare(sess.score(batch))")
    m = dict(batch.info.get("metrics", {}))
    t0 = time.perf_counter()
    off_policy = batch.info.get("off_policy")
    out = batch.replace()
    if not off_policy:  # a batch prepared before: its old log-probs may be stale
        out = Batch({k: v for k, v in out.tensors.items() if k not in ("old_logprobs_BR", "is_weights_BR")},
                    out.meta, {k: v for k, v in out.info.items() if k != "kl_current"})
    if off_policy:  # one step off-policy: the importance ratio is against the policy that generated the batch
        out["old_logprobs_BR"] = batch["rollout_logprobs_BR"]
    elif reuse:  # the update's own forward: valid only with these weights and settings
        out.info["logprobs_epoch"] = epoch
    calls = start_forwards(workers, batch, reference=cfg.uses_reference, logprobs=not off_policy and not reuse,
                           values="critic" in workers and not has_current_values(batch, epoch))
    for done in finish_all(lambda: None, *calls.values())[1]:
        out.update(Batch.cat(done))
    prepared = advantages_for(batch, out, cfg.algo, uses_reference=cfg.uses_reference, kl_coef=kl_coef)
    out.update({**prepared.tensors, "advantage": prepared.advantage})
    if prepared.kl_current is not None:  # the KL controller moves when the step is taken (update)
        out.info["kl_current"] = prepared.kl_current
    m.update(prepared.metrics)
    seconds = time.perf_counter() - t0
    m.update({"time/prepare_s": seconds, **compute.advantage_metrics(out),
              **compute.throughput(out, "prepare", seconds)})
    out.info["metrics"] = m
    return out


def reuses_logprobs(cfg, workers: Workers, step: int) -> bool:
    """algo.reuse_logprobs, where it is exact: one epoch of one mini-batch, so every forward of the update
    runs on the weights a separate forward in prepare() would have used. Not with algo.rollout_is (it weighs
    the trainer's log-probs against the engine's before the update) nor with the KL in the reward (the
    advantages need it before the update); a KL loss is measured by the update's forward."""
    t, a = cfg.train, cfg.algo
    return (a.reuse_logprobs and t.epochs == 1 and t.mini_batches == 1 and a.rollout_is == "off"
            and not (cfg.uses_reference and a.kl_in == "reward")
            and ("critic" not in workers or step >= t.critic_warmup))  # a policy update runs


def train(workers: Workers, batch: Batch, t, step: int, kl_coef: float, m: dict) -> tuple[dict, bool, tuple | None]:
    """The critic's and then the policy's optimizer steps on `batch` (the policy's from `t.critic_warmup`
    on), their metrics into `m`. Returns (role -> its optimizer's step count now, whether the policy moved,
    the weight push already queued behind the policy's update where the backend overlaps them, or None)."""
    steps = {}
    if "critic" in workers:
        critic = workers.groups["critic"]
        shards = minibatch_major(batch, t.mini_batches, critic.world_size)
        m.update(compute.mean_over_ranks(critic.call_shards(CriticWorker.update, shards)))
        steps["critic"] = int(m.pop("adam_steps"))
    if step < t.critic_warmup:
        return steps, False, None
    policy = workers.groups["policy"]
    pending = policy.submit_shards(PolicyWorker.update, minibatch_major(batch, t.mini_batches, policy.world_size),
                                   kl_coef)
    early = workers.start_sync(step + 1) if workers.pushes_behind_update() else None
    m.update(compute.mean_over_ranks(policy.collect(pending)))
    steps["policy"] = int(m.pop("adam_steps"))
    return steps, True, early


def push(workers: Workers, early: tuple | None, version: int, meanwhile: Callable[[], None] = lambda: None) -> dict:
    """The update's weights to the engines (`early`: the push train() queued behind the update; its
    sync/s counts what it added after the update); `meanwhile()` runs while the engines load them."""
    if early:
        return workers.finish_sync(early, since=time.perf_counter(), meanwhile=meanwhile)
    return workers.sync(version, meanwhile=meanwhile)


def submit(workers: Workers, role: str, method, batch: Batch) -> tuple[WorkerGroup, Pending]:
    """`method` on `role`'s ranks, each on its shard of `batch`: (group, pending) for `finish_all`."""
    group = workers.groups[role]
    return group, group.submit_shards(method, batch)


def start_values(workers: Workers, batch: Batch) -> tuple | None:
    """The critic's value pass over `batch` (beside the rewards, in score), or None without a critic or
    without tokens (rewards only: the values come in prepare)."""
    if "critic" not in workers or "response_mask_BR" not in batch:
        return None
    return submit(workers, "critic", CriticWorker.compute_values, batch)


def start_forwards(workers: Workers, batch: Batch, *, logprobs: bool, reference: bool, values: bool) -> dict:
    """prepare's forward passes, all submitted at once, each on its own workers (Ray runs them side by side):
    the policy's old log-probs, the reference's (with LoRA: the policy's own model with its adapters off),
    the critic's values. role -> (group, pending)."""
    calls = {}
    if logprobs:
        calls["policy"] = submit(workers, "policy", PolicyWorker.compute_logprobs, batch)
    if reference:
        calls["reference"] = (submit(workers, "reference", ReferenceWorker.compute_logprobs, batch)
                              if "reference" in workers else
                              submit(workers, "policy", PolicyWorker.reference_logprobs, batch))
    if values:
        calls["critic"] = submit(workers, "critic", CriticWorker.compute_values, batch)
    return calls


def greedy(cfg, max_new_tokens: int | None, positions: int | None):
    """An evaluation's sampling: one greedy response per prompt, up to `max_new_tokens` (None: rollout's), which
    after prompts of data.max_prompt_len tokens must fit in the model's `positions` where they are known."""
    if max_new_tokens is not None and not is_count(max_new_tokens, 1):
        raise UsageError(f"max_new_tokens={max_new_tokens!r}: a whole number of tokens, 1 or more (None: "
                         f"rollout.max_new_tokens, {cfg.rollout.max_new_tokens})")
    prompt_len = cfg.data.max_prompt_len
    if max_new_tokens and positions and prompt_len + max_new_tokens > positions:
        raise UsageError(f"max_new_tokens={max_new_tokens} after prompts of up to data.max_prompt_len={prompt_len} "
                         f"tokens is more than the model's {positions} positions: at most {positions - prompt_len}")
    return cfg.rollout.greedy(max_new_tokens)


def evaluate(workers: Workers, prompts: PromptCodec, rows: list[dict], params, env_cls) -> tuple[Batch, dict]:
    """Greedy responses to `rows` scored by the reward workers (or episodes scored by `env_cls`): the
    decoded batch with its `scores_B`, and the evaluation's metrics."""
    batch = prompts.encode(rows, 1, tag="eval")
    rollout = workers.groups["rollout"]
    if env_cls is not None:
        rows_in = batch.only("prompt", *batch.info.get("row_fields", ()))
        parts = rollout.collect(rollout.submit_shards(RolloutWorker.generate_episodes, rows_in, env_cls, params))
        scores = torch.cat([part["env_scores_B"] for part in parts])
        called = torch.cat([part["tool_calls_B"] for part in parts]) > 0
        extra = {"eval/tool_use": called.float().mean().item()}
        batch = None  # episodes keep no file of their own
    else:
        extra = {}
        generated = rollout.call_split(RolloutWorker.generate, generate_inputs(batch), params)
        batch = prompts.decode(batch.replace(generated))
        scored = workers.groups["reward"].call_split(RewardWorker.score, reward_inputs(batch))
        batch = scored_batch(batch, scored.only("scores_B", "reward_parts"))
        scores = batch["scores_B"]
        extra = {"eval/response_len": batch["response_len_B"].float().mean().item(),
                 **compute.part_metrics(batch.meta.get("reward_parts"), "eval")}
    return batch, {"eval/accuracy": (scores >= 1.0).float().mean().item(), "eval/reward_mean": scores.mean().item(),
                   "eval/n": len(rows), **extra}
