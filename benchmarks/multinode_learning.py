"""The seed's whole pipeline learning on several Ray nodes: PPO with critic, learned reward model and reference,
each role in a pool of its own, the pools pinned to three nodes, trained on the reward model's score alone.

    python benchmarks/multinode_learning.py                      # configs/arith_ppo_rm.yaml, 150 steps
    python benchmarks/multinode_learning.py --steps 1 task.num_train=300 --json out.json

Three real Ray nodes on this machine (`ray.cluster_utils.Cluster`: a head and two workers, each with its own
raylet and object store; custom resources and a label the pools select them by): the policy on node a, the
rollout, critic, reward model and reward function on node b, the reference on the head with `device: cpu`.
Weights cross nodes through the object store. Prints where each rank ran, held-out accuracy before and after
(the verifier only measures), and seconds per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

import rlbench_nb as rl

REPO = Path(__file__).resolve().parent.parent
POOLS = ("cluster.pools={train: {resources: {node_a: 0.01}}, gen: {labels: {zone: b}}, "
         "scorers: {labels: {zone: b}, cpus_per_worker: 0.25}, cpu: {device: cpu, resources: {head: 0.01}}}")
ROLE_POOLS = ("cluster.role_pools={policy: train, rollout: gen, critic: scorers, reward_model: scorers, "
              "reward: scorers, reference: cpu}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--config", default=str(REPO / "configs" / "arith_ppo_rm.yaml"))
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*", help="config overrides")
    args = p.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    nodes = {"head": cluster.head_node, "a": cluster.add_node(num_cpus=2, resources={"node_a": 1}),
             "b": cluster.add_node(num_cpus=2, labels={"zone": "b"})}
    cluster.wait_for_nodes()
    names = {n.node_id[:6]: k for k, n in nodes.items()}
    try:
        cfg = rl.Config.load(args.config, [
            f"run.dir={tempfile.mkdtemp()}", "cluster.backend=ray", f"cluster.address={cluster.address}",
            "cluster.num_threads=1", "cluster.cpus_per_worker=0.5", "run.tensorboard=false", POOLS, ROLE_POOLS,
            *args.overrides])
        with rl.Session(cfg) as sess:
            where = [(role, rank, pool, names.get(node[-6:], node), device)
                     for role, rank, pool, node, _, device, _ in sess.workers.table()]
            summary = sess.run(args.steps, progress=False)
            transport = sess.groups["policy"].last_transport
            rows = [json.loads(line) for line in (sess.run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    step_s = statistics.median(r["time/step_s"] for r in rows if "time/step_s" in r)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    print("\nbackend: ray on three nodes (head, a, b); the reward is the reward model's alone")
    print(f"{'role':<13} {'rank':>4}  {'pool':<8} {'node':<5} device")
    for role, rank, pool, node, device in where:
        print(f"{role:<13} {rank:>4}  {pool:<8} {node:<5} {device}")
    print(f"\nweight push: {transport}; {args.steps} steps, median {step_s:.2f} s/step")
    print(f"{'step':>5} {'held-out accuracy':>18}")
    for step, acc in evals:
        print(f"{step:>5} {acc:>18.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"placement": where, "transport": transport, "step_s": step_s,
                                               "evals": evals, "summary": summary}))


if __name__ == "__main__":
    main()
