"""Resource pools: which pool each role's workers come from, what one worker reserves there, and whether
the cluster can hold them all, checked before any actor starts.

    placement(cfg, "critic")   # Placement(pool='scorers', bundle={'CPU': 0.5, 'node_b': 0.01}, labels={}, device='cpu')
    check_fits(cfg, {"policy": 2, "critic": 1}, ray_nodes())   # ClusterError naming the pool and what it lacks

Without `cluster.pools` every role is in one implicit pool, 'default', of cluster.cpus_per_worker /
gpus_per_worker anywhere. The config itself (a role with no pool, an unknown pool, colocation across pools)
is checked where it is parsed (config.py); here is what needs the live cluster.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ClusterError


@dataclass(frozen=True)
class Placement:
    pool: str
    bundle: dict[str, float]    # what one worker reserves: CPU, GPU, custom resources
    labels: dict[str, str]      # node labels its node must carry
    device: str                 # 'auto', 'cuda' or 'cpu'


def placement(cfg, role: str) -> Placement:
    from ..config import PoolConfig
    c = cfg.cluster
    name = c.role_pools.get(role, "default") if c.pools else "default"
    pool = c.pools.get(name, PoolConfig())
    cpus = c.cpus_per_worker if pool.cpus_per_worker is None else pool.cpus_per_worker
    gpus = c.gpus_per_worker if pool.gpus_per_worker is None else pool.gpus_per_worker
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **pool.resources}
    return Placement(name, bundle, dict(pool.labels), pool.device)


def ray_nodes() -> list[dict]:
    """The live nodes of the attached Ray cluster: id, ip, total resources, labels."""
    import ray
    return [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "resources": dict(n["Resources"]),
             "labels": dict(n.get("Labels") or {})} for n in ray.nodes() if n.get("Alive")]


def check_fits(cfg, sizes: dict[str, int], nodes: list[dict]) -> None:
    """Refuse, one line naming the pool, a layout the cluster cannot hold whatever else runs on it: a worker
    that no single node could host, a pool with more workers than its nodes hold whole ones of, or pools that
    together need more than the cluster has.
    `sizes`: role -> number of actors of its own (a role living in another's processes counts 0)."""
    by_pool: dict[str, list[tuple[str, int, Placement]]] = {}
    for role, n in sizes.items():
        if n:
            p = placement(cfg, role)
            by_pool.setdefault(p.pool, []).append((role, n, p))
    for pool, members in by_pool.items():
        p = members[0][2]
        who = ", ".join(f"{role} x{n}" for role, n, _ in members)
        where = f"cluster.pools.{pool}" if cfg.cluster.pools else "cluster.cpus_per_worker / gpus_per_worker"
        eligible = [n for n in nodes if all(n["labels"].get(k) == v for k, v in p.labels.items())]
        hosts = [n for n in eligible if all(n["resources"].get(k, 0.0) >= v for k, v in p.bundle.items())]
        if not hosts:
            labels = f" on a node labelled {p.labels}" if p.labels else ""
            raise ClusterError(
                f"pool '{pool}' ({who}): one worker needs {_fmt(p.bundle)}{labels}, and no node of the cluster "
                f"has that (nodes: {'; '.join(_node(n) for n in nodes) or 'none'}) — start a node that has it "
                f"(`ray start --resources='{{...}}'` / `--labels`, `--num-gpus`) or change {where}")
        workers, slots = sum(n for _, n, _ in members), sum(_slots(n, p.bundle) for n in eligible)
        if workers > slots:  # a worker lives on one node (leftovers do not add up): this covers "too little in all"
            raise ClusterError(f"pool '{pool}' ({who}) needs {workers} workers of {_fmt(p.bundle)}, but its nodes "
                               f"hold at most {slots} whole ones — lower its ranks or per-worker share ({where}), "
                               "or add nodes")
    demand: dict[str, dict[str, float]] = {}  # resource -> pool -> amount
    for pool, members in by_pool.items():
        for _, n, p in members:
            for key, amount in p.bundle.items():
                demand.setdefault(key, {}).setdefault(pool, 0.0)
                demand[key][pool] += n * amount
    for key, per_pool in demand.items():
        have = sum(n["resources"].get(key, 0.0) for n in nodes)
        if len(per_pool) > 1 and sum(per_pool.values()) > have + 1e-9:
            parts = ", ".join(f"{pool} {amount:g}" for pool, amount in per_pool.items())
            raise ClusterError(f"the pools need {sum(per_pool.values()):g} {key} in all ({parts}), but the cluster "
                               f"has {have:g} — lower ranks or per-worker shares (cluster.pools), or add nodes")


def _slots(node: dict, bundle: dict[str, float]) -> int:
    """How many workers of `bundle` fit on `node` (1e-9: 0.7 / 0.1 is 6.999... in floating point)."""
    return min(int(node["resources"].get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0)


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _node(n: dict) -> str:
    shown = {k: v for k, v in n["resources"].items()
             if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type"))}
    labels = _user_labels(n)
    return f"{n['ip']} {_fmt(shown)}" + (f" labels {labels}" if labels else "")


def _user_labels(n: dict) -> dict:
    return {k: v for k, v in n["labels"].items() if not k.startswith("ray.io/")}
