"""Watching a run's numbers for what must stop it: updates skipped for non-finite losses or gradients."""
from __future__ import annotations

import logging

from ..errors import NonFiniteError

log = logging.getLogger(__name__)

_ROLES = (("policy", "update/skipped"), ("critic", "update/critic_skipped"))


class SkipWatch:
    """A warning for each step whose update skipped optimizer steps; `NonFiniteError` once a role skipped
    its whole update `limit` steps in a row (the step's metrics row is written before)."""

    def __init__(self, steps_per_update: int, limit: int):
        self.steps_per_update, self.limit = steps_per_update, limit
        self.in_a_row = 0

    def observe(self, step: int, row: dict) -> None:
        skipped = {role: row.get(key, 0) for role, key in _ROLES}
        if not any(skipped.values()):
            self.in_a_row = 0
            return
        what = " and ".join(name for name, suffix in (("loss", "_nonfinite_loss"), ("gradient norm", "_nonfinite_grad"))
                            if any(row.get(key + suffix) for _, key in _ROLES))
        roles = " and ".join(role for role, n in skipped.items() if n)
        log.warning("step %d: %s: %g of %d optimizer step(s) skipped: non-finite %s (weights and optimizer "
                    "untouched)", step, roles, max(skipped.values()), self.steps_per_update, what)
        self.in_a_row = self.in_a_row + 1 if max(skipped.values()) >= self.steps_per_update else 0
        if self.in_a_row >= self.limit:
            self.in_a_row = 0
            raise NonFiniteError(
                f"the {roles} update was skipped {self.limit} steps in a row (up to step {step}): non-finite "
                f"{what}. The weights are those of the last good update and every metric row is written; look at "
                "reward/* and advantage/* in metrics.jsonl, lower train.lr, or check the reward function's scale, "
                "then resume from the latest checkpoint")


def mismatch_alarm(row: dict, limit: float | None, step: int) -> None:
    """`mismatch/alarm` in `row`: the engine's log-probs drifted from the trainer's past `limit`
    (algo.mismatch_alarm: a stale or half-loaded engine, a dtype or kernel difference); said once per step,
    and shown in the dashboard."""
    seen = row.get("mismatch/logp_abs_mean")
    if limit is None or seen is None:
        return
    row["mismatch/alarm"] = float(seen > limit)
    if seen > limit:
        log.warning("step %d: the rollout engine's log-probs differ from the trainer's by %.4f per token on "
                    "average (max %.4f; alarm above algo.mismatch_alarm=%g): check the weight sync and the "
                    "engine's dtype, or correct with algo.rollout_is=tis", step, seen,
                    row.get("mismatch/logp_abs_max", float("nan")), limit)
