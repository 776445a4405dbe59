"""The optimisation loop every trained role shares (policy and critic): epochs x mini-batches x
micro-batches, with counts all-reduced across ranks, finite checks, clipping and skip accounting.

A role supplies `loss_fn(micro_batch, counts) -> (loss, stats)`: the micro-batch's share of the
mini-batch loss, normalised by the whole mini-batch's token and sequence `counts` (summed over ranks),
so neither micro-batching nor sharding changes the gradient; and its share of each statistic, so they
add up over micro-batches and ranks to the mini-batch's value.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..config import TrainConfig
from ..data.batch import Batch, trained_tokens
from . import distributed as dist_util
from .packing import micro_batches

LossFn = Callable[[Batch, dict], tuple[torch.Tensor, dict]]


def optimizer_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, t: TrainConfig,
                    loss_fn: LossFn, *, grad_norm_key: str, skip_key: str) -> dict:
    """`t.epochs` passes over `batch`, each `t.mini_batches` optimizer steps. Returns the mean of each
    statistic over the steps taken (with `grad_norm_key`), `skip_key` (steps skipped) with
    `<skip_key>_nonfinite_loss` / `_grad` saying which number was not finite, and `adam_steps`."""
    totals: dict[str, float] = {}
    taken = 0
    skips = {f"{skip_key}_nonfinite_loss": 0, f"{skip_key}_nonfinite_grad": 0}
    for _ in range(t.epochs):
        for mini in batch.chunk(t.mini_batches):
            stats = _optimizer_step(model, optimizer, mini, t, loss_fn, grad_norm_key)
            if isinstance(stats, str):
                skips[f"{skip_key}_nonfinite_{stats}"] += 1
                continue
            taken += 1
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
    out = {k: v / max(taken, 1) for k, v in totals.items()}
    out[skip_key] = sum(skips.values())
    out.update(skips)
    out["adam_steps"] = adam_steps(model, optimizer)  # the count so far: the session keeps it (attach checks it)
    return out


def loss_counts(mini: Batch) -> dict:
    """The mini-batch's loss denominators, summed over ranks: its trained tokens, and the sequences that have any
    (a sequence algo.rollout_is=mis rejected has none: it counts in neither)."""
    trained = trained_tokens(mini).float()
    return {"num_tokens": dist_util.all_reduce_sum(trained.sum()),
            "num_seqs": dist_util.all_reduce_sum((trained.sum(-1) > 0).float().sum())}


def _optimizer_step(model, optimizer, mini: Batch, t: TrainConfig, loss_fn: LossFn, grad_norm_key: str) -> dict | str:
    """One optimizer step over `mini`: its stats, or "loss" / "grad" when a non-finite loss or gradient
    norm made it skip. Skipping leaves weights and optimizer state untouched, and every rank takes the
    same branch (FSDP's backward and the optimizer step are collectives)."""
    counts = loss_counts(mini)
    world = dist_util.world_size()  # FSDP averages gradients over ranks; the losses are shares of a sum
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for mb in micro_batches(mini, t):
        loss, stats = loss_fn(mb, counts)
        if dist_util.all_reduce_sum(torch.tensor(0.0 if torch.isfinite(loss) else 1.0)) > 0:
            optimizer.zero_grad(set_to_none=True)
            return "loss"
        (loss * world).backward()
        for k, v in stats.items():  # shares add up; a `_max` statistic is the largest
            sums[k] = max(sums.get(k, float("-inf")), float(v)) if k.endswith("_max") else sums.get(k, 0.0) + float(v)
    grad_norm = dist_util.local_scalar(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return "grad"
    optimizer.step()
    _check_finite_weights(model, optimizer, grad_norm)
    keys = sorted(k for k in sums if not k.endswith("_max"))  # shards' shares -> the mini-batch's values
    totals = dist_util.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    out = dict(zip(keys, totals.tolist()))
    maxima = sorted(k for k in sums if k.endswith("_max"))
    if maxima:  # every rank reports the same keys (the same loss on the same fields)
        out.update(zip(maxima, dist_util.all_reduce_max(torch.tensor([sums[k] for k in maxima],
                                                                     dtype=torch.float64)).tolist()))
    out[grad_norm_key] = grad_norm
    return out


def adam_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far (Adam's own count, in checkpoints and snapshots with its state): what the
    session's record of its trainers must agree with (Session.attach checks it)."""
    state = next((optimizer.state[p] for p in model.parameters() if p in optimizer.state), None)
    return int(state["step"]) if state else 0


class NonFiniteWeightsError(FloatingPointError):
    """The weights themselves became non-finite in an optimizer step (finite loss and gradient)."""


def _check_finite_weights(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_norm: float) -> None:
    """A finite loss and gradient can still give non-finite weights (an overflowing learning rate or Adam
    state). The step cannot be undone in place, so training stops here, before the weights spread to the
    rollout engine or a checkpoint."""
    from torch.distributed.tensor import DTensor
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    bad = torch.stack([(~torch.isfinite(p)).any() for p in local]).sum().float().cpu()  # one device sync
    if dist_util.all_reduce_sum(bad) > 0:
        lr = optimizer.param_groups[0]["lr"]
        raise NonFiniteWeightsError(
            f"the weights became non-finite in an optimizer step (lr={lr:g}, gradient norm {grad_norm:.3g}, both "
            "finite): nothing was pushed to the rollout engine or saved. Lower train.lr and continue from the "
            "latest checkpoint (sess.resync() in a notebook, --resume for a script)")
