"""Checks for RL functions written in a notebook cell (`@sess.advantage`, `@sess.policy_loss`,
`@sess.reward`) before they are used: each is tried on a two-sample batch, and a function that will be
shipped to worker processes must survive pickling. A failure is one `UsageError` naming the function and
the reason, at the cell that defined it, instead of an error inside a worker steps later."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import UsageError

# two samples of one group, three response tokens, the second sample one token shorter
_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
_LOGPROBS = torch.tensor([[-0.5, -1.0, -0.2], [-0.7, -0.3, 0.0]])


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def shippable(fn: Callable, what: str, where: str) -> None:
    """Refuse a function that cannot be cloudpickled (as Ray ships it), under every backend, so a notebook
    that works locally works on a cluster."""
    if not callable(fn):
        raise UsageError(f"a {what} must be a function, got {type(fn).__name__}")
    try:
        import cloudpickle
        cloudpickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises is the reason
        raise UsageError(f"{what} '{_name(fn)}' cannot be shipped to the {where}: {type(e).__name__}: {e} — define "
                         "it at the top level of a cell and keep locks, open files, sessions and models out of "
                         "what it captures") from None


def _tried(fn: Callable, what: str, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{what} '{_name(fn)}' fails on a two-sample batch: {type(e).__name__}: {e}") from None


def _check_tensor(out, what: str, fn, shape=(2, 3)) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UsageError(f"{what} '{_name(fn)}' must return a [B, R] tensor (here {shape}); got {got}")


def check_advantage(fn: Callable, cfg) -> None:
    """fn(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg) -> (advantages_BR, returns_BR or None)."""
    if not callable(fn):
        raise UsageError(f"an advantage estimator must be a function, got {type(fn).__name__}")
    out = _tried(fn, "advantage estimator", _REWARDS.clone(), _MASK.clone(), group_ids=["g", "g"],
                 values_BR=torch.zeros(2, 3), cfg=cfg)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise UsageError(f"advantage estimator '{_name(fn)}' must return (advantages_BR, returns_BR or None), "
                         f"got {type(out).__name__}")
    _check_tensor(out[0], "advantage estimator", fn)


def check_policy_loss(fn: Callable, cfg) -> None:
    """fn(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg) -> loss_BR or (loss_BR, stats)."""
    if not callable(fn):
        raise UsageError(f"a policy loss must be a function, got {type(fn).__name__}")
    lp = _LOGPROBS.clone().requires_grad_(True)
    out = _tried(fn, "policy loss", lp, _LOGPROBS.clone(), torch.tensor([[1.0] * 3, [-1.0] * 3]), _MASK.clone(),
                 cfg=cfg)
    loss, stats = out if isinstance(out, tuple) else (out, {})
    _check_tensor(loss, "policy loss", fn)
    if not isinstance(stats, dict):
        raise UsageError(f"policy loss '{_name(fn)}' returned stats of type {type(stats).__name__}: use a dict")
    if not loss.requires_grad:
        raise UsageError(f"policy loss '{_name(fn)}' does not depend on logprobs_BR (no gradient would reach the "
                         "policy): build the loss from the first argument")
