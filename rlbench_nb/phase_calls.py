"""What each phase asks of which workers: the calls behind `Session.rollout`, `score`, `prepare` and
`evaluate`. Session keeps the order of the phases, their metrics and the state they move; these functions
only fan a batch out to the roles (side by side where the backend can) and gather what comes back.

    started = start_rollout(workers, prompt_batch, cfg, env_cls, draw)  # the engines generate ...
    batch = collect_rollout(workers, prompts, started, step, max_new)  # ... and the batch comes back decoded
    scored = rewards(workers, reward_inputs(batch), batch)             # rule fn (+ reward model), combined
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cluster.base import Pending, WorkerGroup, finish_all
from .cluster.workers import Workers
from .data.batch import Batch
from .determinism import sample_seeds
from .metrics import compute
from .prompts import PromptCodec, generate_inputs, reward_inputs
from .roles import CriticWorker, PolicyWorker, ReferenceWorker, RewardModelWorker, RewardWorker
from .roles.rollout.base import RolloutWorker


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
