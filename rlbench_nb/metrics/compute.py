"""Metrics as functions of a phase's batch: the controller only collects them (as verl's
`compute_data_metrics`). Keys are `group/name`; docs/metrics.md says what each means."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ..algos import masked_mean
from ..algos.advantages import tied_share
from ..data.batch import Batch, trained_tokens


@contextmanager
def timed(metrics: dict, key: str):
    """metrics[key] = seconds spent in the block (also when it raises)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = time.perf_counter() - t0


def rollout_metrics(batch: Batch, seconds: float, max_new_tokens: int) -> dict:
    lens = batch["response_mask_BR"].sum(-1).float()
    return {"time/rollout_s": seconds,
            "throughput/rollout_tok_s": lens.sum().item() / max(seconds, 1e-9),
            "response_len/mean": lens.mean().item(), "response_len/max": lens.max().item(),
            "response_len/min": lens.min().item(),
            "response_len/clip_frac": (lens >= max_new_tokens).float().mean().item(),
            **(episode_metrics(batch) if "num_turns_B" in batch else {})}


def episode_metrics(batch: Batch) -> dict:
    """Multi-turn episodes (env.fn): turns, tool calls and failures per episode, the share of episodes that
    called a tool; the share of their tokens the model wrote (the rest are the environment's, with no loss on them)."""
    return {"env/turns": batch["num_turns_B"].float().mean().item(),
            "env/tool_calls": batch["tool_calls_B"].float().mean().item(),
            "env/tool_use": (batch["tool_calls_B"] > 0).float().mean().item(),
            "env/tool_errors": batch["tool_errors_B"].float().mean().item(),
            "env/errors": sum(1 for e in batch["env_error"] if e),
            "env/model_token_share":
                (batch["loss_mask_BR"].sum() / batch["response_mask_BR"].sum().clamp(min=1)).item()}


def reward_metrics(batch: Batch) -> dict:
    scores = batch["scores_B"]
    return {"reward/mean": scores.mean().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
            "reward/min": scores.min().item(), "reward/max": scores.max().item(),
            "reward/errors": sum(1 for e in batch["reward_error"] if e),
            **part_metrics(batch.meta.get("reward_parts"), "reward"),
            **(model_vs_rule(batch) if "rm_scores_B" in batch else {})}


def part_metrics(parts: list[dict | None] | None, prefix: str) -> dict:
    """`<prefix>/part/<name>`: the mean of each part of a `Scored` reward (rewards/scored.py) over the samples
    that have it (a sample whose reward failed has none), in the order the parts first appear."""
    sums: dict[str, list[float]] = {}
    for sample in parts or ():
        for name, value in (sample or {}).items():
            sums.setdefault(name, []).append(float(value))
    return {f"{prefix}/part/{name}": sum(v) / len(v) for name, v in sums.items()}


def model_vs_rule(batch: Batch) -> dict:
    """The reward model's and the rule's means, and `reward/model_disagree`: of the pairs of samples of one
    prompt that the rule tells apart, the share the model orders the other way (a tie counts half). Pairs,
    not a threshold: a reward model's scale is its own. Absent when no pair is told apart."""
    rm, rule = batch["rm_scores_B"], batch["rule_scores_B"]
    out = {"reward/model": rm.mean().item(), "reward/rule": rule.mean().item()}
    if "group" not in batch:  # a batch made by hand: no prompts to pair samples within
        return out
    groups: dict = {}
    for i, g in enumerate(batch["group"]):
        groups.setdefault(g, []).append(i)
    wrong = pairs = 0.0
    for rows in groups.values():
        idx = torch.tensor(rows)
        apart = torch.sign(rule[idx][:, None] - rule[idx][None, :])  # +1 where the rule prefers i over j
        agree = torch.sign(rm[idx][:, None] - rm[idx][None, :]) * apart
        told = apart > 0
        pairs += told.sum().item()
        wrong += ((agree[told] < 0).sum() + 0.5 * (agree[told] == 0).sum()).item()
    if pairs:
        out["reward/model_disagree"] = wrong / pairs
    return out


def advantage_metrics(batch: Batch) -> dict:
    adv, mask = batch["advantages_BR"], trained_tokens(batch).float()
    out = {"advantage/mean": masked_mean(adv, mask).item(), "advantage/abs_max": (adv.abs() * mask).max().item()}
    if "scores_B" in batch and "group" in batch.meta:
        # prompts that teach nothing this step; near 1, the prompts are too easy or too hard for the model
        out["advantage/tied_groups"] = tied_share(batch["scores_B"], batch.meta["group"])
    if "values_BR" in batch:
        out["critic/values_mean"] = masked_mean(batch["values_BR"], mask).item()
    return out


def total_tokens(batch: Batch) -> float:
    """Prompt + response tokens (padding excluded): the unit of trainer throughput."""
    return (batch["prompt_mask_BP"].sum() + batch["response_mask_BR"].sum()).item()


def throughput(batch: Batch, phase: str, seconds: float, passes: int = 1) -> dict:
    """`throughput/<phase>_tok_s`: prompt + response tokens processed per second (x passes over the batch)."""
    return {f"throughput/{phase}_tok_s": total_tokens(batch) * passes / max(seconds, 1e-9)}


def mean_over_ranks(stats: list[dict]) -> dict:
    """Each rank reports the same global numbers (all-reduced) or its share: their mean is the step's."""
    keys = {k for s in stats for k in s}
    return {k: sum(s.get(k, 0.0) for s in stats) / len(stats) for k in keys}


def memory_metrics(groups: dict) -> dict:
    """`memory/<role>_peak_gb`: peak RSS of the processes running each role, from the last calls' reports."""
    return {f"memory/{role}_peak_gb": max((v["peak_rss_gb"] for v in g.memory.values()), default=0.0)
            for role, g in groups.items()}


def step_seconds(metrics: dict, wall_start: float | None) -> float:
    """`time/step_s`: phases in sequence add up; an overlapped (async) step reports its wall time."""
    if wall_start is not None:
        return time.perf_counter() - wall_start
    return sum(metrics.get(f"time/{p}_s", 0.0) for p in ("rollout", "score", "prepare", "update"))

