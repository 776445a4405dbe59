"""The phase timeline: how much of the rollout ran concurrently with the other roles' work."""
from __future__ import annotations


def overlap_fraction(groups: dict, since: float) -> float:
    """Share of rollout 'generate' time during which another role was working (from the call records)."""
    gen = [(r.start, r.end) for r in groups["rollout"].records
           if r.method in ("generate", "generate_episodes") and r.start >= since]
    others = [(r.start, r.end) for role, g in groups.items() if role != "rollout" for r in g.records
              if r.start >= since and r.method in ("update", "compute_logprobs", "compute_values", "score")]
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
