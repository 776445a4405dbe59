"""Resource pools across Ray nodes: three real nodes (a head and two workers, each its own raylet and
object store) on this machine, with custom resources and labels that pools pin roles to."""
import pytest

import rlbench_nb as rl
from rlbench_nb.cluster import ClusterError

from ..conftest import assert_rollout_holds_policy_weights

ray = pytest.importorskip("ray")

PPO = ["cluster.backend=ray", "run.tensorboard=false", "cluster.num_threads=1", "algo.advantage=gae",
       "algo.kl_coef=0.05", "cluster.cpus_per_worker=0.5"]
POOLS = ("cluster.pools={train: {resources: {node_a: 0.01}}, gen: {labels: {zone: b}}, "
         "scorers: {labels: {zone: b}, cpus_per_worker: 0.25}, cpu: {device: cpu, resources: {head: 0.01}}}")
ROLE_POOLS = ("cluster.role_pools={policy: train, rollout: gen, critic: scorers, reward_model: scorers, "
              "reward: scorers, reference: cpu}")


@pytest.fixture(scope="module")
def three_nodes():
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    nodes = {"head": cluster.head_node, "a": cluster.add_node(num_cpus=2, resources={"node_a": 1}),
             "b": cluster.add_node(num_cpus=2, labels={"zone": "b"})}
    cluster.wait_for_nodes()
    yield cluster, {k: n.node_id[:6] for k, n in nodes.items()}
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow  # ~2 min: three raylets and five model roles on 2 cores
def test_ppo_with_each_role_in_its_pool_on_three_nodes(three_nodes, small_cfg, tmp_path):
    """PPO with critic, reward model and reference, each pool pinned to a node: every rank lands where its
    pool says, the policy's weights reach the rollout on another node through the object store (not /dev/shm,
    which a node does not share), the critic's values and the reward model's scores are computed at once, and
    `sess` shows role, pool, node and device."""
    from ..chat_model import make_reward_model
    from ..roles.test_reward_model import CORPUS
    cluster, node = three_nodes
    rm = make_reward_model(tmp_path / "rm", CORPUS)
    sess = rl.Session(small_cfg(*PPO, f"cluster.address={cluster.address}", f"reward.model.path={rm}", POOLS,
                                ROLE_POOLS))
    try:
        where = {row[0]: (row[2], row[3][-6:], row[5]) for row in sess.workers.table()}
        assert where == {"policy": ("train", node["a"], "cpu"), "rollout": ("gen", node["b"], "cpu"),
                         "reward": ("scorers", node["b"], "cpu"), "reward_model": ("scorers", node["b"], "cpu"),
                         "reference": ("cpu", node["head"], "cpu"), "critic": ("scorers", node["b"], "cpu")}
        rows = [sess.step() for _ in range(2)]
        assert sess.groups["policy"].last_transport == "store"
        assert_rollout_holds_policy_weights(sess)
        assert all(r["sync/bytes"] > 0 and "reward/model" in r for r in rows)
        values = [r for r in sess.groups["critic"].records if r.method == "compute_values"]
        scores = [r for r in sess.groups["reward_model"].records if r.method == "score"]
        assert len(values) == len(scores) == 2  # one value pass a step: prepare reused score's
        for v, s in zip(values, scores):  # both in flight at once, not one after the other
            assert max(v.start, s.start) < min(v.end, s.end)
        assert f"critic       rank 0  pool=scorers node={cluster.address.split(':')[0]}/{node['b']}" in repr(sess)
    finally:
        sess.close()


@pytest.mark.slow  # shares the three-node cluster of the test above
def test_a_pool_no_node_can_host_is_refused_before_anything_starts(three_nodes, small_cfg):
    cluster, _ = three_nodes
    bad = POOLS.replace("labels: {zone: b}, cpus", "labels: {zone: c}, cpus")
    with pytest.raises(ClusterError, match=r"pool 'scorers' \(reward x1, critic x1\): one worker needs "
                                           r"\{CPU: 0.25\} on a node labelled \{'zone': 'c'\}, and no node"):
        rl.Session(small_cfg(*PPO, f"cluster.address={cluster.address}", bad, ROLE_POOLS))
    assert not [a for a in ray.util.list_named_actors(True) if a["namespace"] == "rlbench-nb"]
