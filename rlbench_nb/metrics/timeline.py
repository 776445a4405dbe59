"""The phase timeline: how much of the rollout ran concurrently with the other roles' work, and how much of a
step each side sat idle."""
from __future__ import annotations

GENERATE = ("generate", "generate_episodes")
TRAIN = ("update", "compute_logprobs", "compute_values")


def overlap_fraction(groups: dict, since: float) -> float:
    """Share of rollout 'generate' time during which another role was working (from the call records)."""
    gen = [(r.start, r.end) for r in groups["rollout"].records if r.method in GENERATE and r.start >= since]
    others = [(r.start, r.end) for role, g in groups.items() if role != "rollout" for r in g.records
              if r.start >= since and r.method in (*TRAIN, "score")]
    total = sum(e - s for s, e in gen)
    covered = 0.0
    for s, e in gen:
        pieces = sorted((max(s, a), min(e, b)) for a, b in others if min(e, b) > max(s, a))
        end = s
        for a, b in pieces:  # union of overlapping intervals inside [s, e]
            a = max(a, end)
            if b > a:
                covered += b - a
                end = b
    return covered / total if total else 0.0


def idle_fractions(groups: dict, since: float, seconds: float) -> dict:
    """`async/rollout_idle` and `async/trainer_idle`: the share of a step (`seconds` long, its calls collected
    since `since`) the rollout ranks spent not generating and the policy ranks spent not training, from the
    workers' own time inside their calls. The rollout collected in a step ran while earlier steps trained,
    so this is the steady state's measure, not one step's exact account."""
    def busy(role: str, methods: tuple) -> float:
        group = groups.get(role)
        if group is None:
            return 0.0
        work = sum(r.work_s for r in group.records if r.end >= since and r.method in methods)
        return work / max(group.world_size, 1)
    idle = {"async/rollout_idle": busy("rollout", GENERATE), "async/trainer_idle": busy("policy", TRAIN)}
    return {k: min(max(1.0 - v / seconds, 0.0), 1.0) if seconds > 0 else 0.0 for k, v in idle.items()}
