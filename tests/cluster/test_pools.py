"""Resource pools: the config's checks (before anything starts) and the fit check against a cluster's nodes
(pure logic: node lists as `ray.nodes()` reports them, no cluster)."""
import pytest

from rlbench_nb.cluster import ClusterError
from rlbench_nb.cluster.pools import check_fits, placement
from rlbench_nb.config import Config, ConfigError

RAY = ["cluster.backend=ray"]
LAYOUT = ["cluster.pools={actor: {gpus_per_worker: 1, device: cuda}, scorers: {cpus_per_worker: 0.5, "
          "resources: {node_b: 0.01}}, cpu: {device: cpu, labels: {zone: a}}}",
          "cluster.role_pools={policy: actor, rollout: actor, critic: scorers, reward: scorers, reference: cpu}",
          "algo.advantage=gae", "algo.kl_coef=0.01", "cluster.train_ranks=2", "cluster.rollout_ranks=2"]


def _cfg(*overrides):
    return Config.from_dict({}, [*RAY, *overrides])


def _node(ip, labels=None, **resources):
    return {"id": ip, "ip": ip, "resources": resources, "labels": labels or {}}


def test_each_role_gets_its_pools_share_and_device():
    cfg = _cfg(*LAYOUT, "cluster.cpus_per_worker=2")
    assert placement(cfg, "policy") == placement(cfg, "rollout")
    p = placement(cfg, "policy")
    assert (p.pool, p.bundle, p.device) == ("actor", {"CPU": 2.0, "GPU": 1.0}, "cuda")  # CPU from the cluster default
    p = placement(cfg, "critic")
    assert (p.pool, p.bundle, p.labels) == ("scorers", {"CPU": 0.5, "node_b": 0.01}, {})
    p = placement(cfg, "reference")
    assert (p.pool, p.bundle, p.labels, p.device) == ("cpu", {"CPU": 2.0}, {"zone": "a"}, "cpu")
    # no pools: every role in 'default', with the cluster's shares
    p = placement(_cfg("cluster.gpus_per_worker=0.5"), "critic")
    assert (p.pool, p.bundle, p.device) == ("default", {"CPU": 0.25, "GPU": 0.5}, "auto")


@pytest.mark.parametrize("overrides, message", [
    (["algo.kl_coef=0"], None),  # without KL there is no reference: its pool mapping is unused, and accepted
    (["cluster.role_pools={policy: actor, rollout: actor, reward: scorers}"],
     "invalid config: role(s) reference, critic have no pool: add them to cluster.role_pools "
     "(pools: actor, scorers, cpu)"),
    (["cluster.role_pools.critc=scorers"],
     "cluster.role_pools names an unknown role 'critc' (did you mean 'critic'?)"),
    (["cluster.role_pools.critic=scorer"],
     "cluster.role_pools.critic names pool 'scorer', which cluster.pools does not define (pools: actor, "
     "scorers, cpu)"),
    (["rollout.colocate=true", "cluster.role_pools.rollout=scorers"],
     "rollout.colocate runs the rollout engine in the policy's processes, so both need one pool: "
     "cluster.role_pools has policy in 'actor' and rollout in 'scorers'"),
    (["cluster.pools.actor.gpus_per_worker=0"],
     "cluster.pools.actor has device 'cuda' but reserves no GPU: set its gpus_per_worker"),
    (["cluster.pools.cpu.resources={GPU: 1}"],
     "invalid value for 'cluster.pools.cpu.resources': {'GPU': 1} — give GPU as cpus_per_worker / "
     "gpus_per_worker, not in resources"),
    (["cluster.pools.actor.gpu_per_worker=1"],
     "unknown config key 'cluster.pools.actor.gpu_per_worker' (did you mean "
     "'cluster.pools.actor.gpus_per_worker'?)"),
])
def test_a_layout_the_config_cannot_mean_is_one_line(overrides, message):
    if message is None:
        assert "reference" not in _cfg(*LAYOUT, *overrides).roles
        return
    with pytest.raises(ConfigError) as e:
        _cfg(*LAYOUT, *overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_pools_without_a_role_map_are_refused():
    with pytest.raises(ConfigError, match="cluster.pools is set but cluster.role_pools maps no role to a pool"):
        _cfg("cluster.pools.a.cpus_per_worker=1")


def test_the_fit_check_names_the_pool_and_what_no_node_has():
    cfg = _cfg(*LAYOUT)
    sizes = {"policy": 2, "rollout": 2, "reward": 1, "reference": 2, "critic": 2}
    gpu_a = _node("10.0.0.1", {"zone": "a"}, CPU=8, GPU=2)
    gpu_b = _node("10.0.0.2", CPU=8, GPU=2, node_b=1)
    check_fits(cfg, sizes, [gpu_a, gpu_b])  # 4 GPU workers over 4 GPUs, the rest where they may go
    # no node has the custom resource the scorers need
    with pytest.raises(ClusterError, match=r"pool 'scorers' \(reward x1, critic x2\): one worker needs "
                                           r"\{CPU: 0.5, node_b: 0.01\}, and no node of the cluster has that "
                                           r"\(nodes: 10.0.0.1 \{CPU: 8, GPU: 2\} labels \{'zone': 'a'\}"):
        check_fits(cfg, sizes, [gpu_a, _node("10.0.0.2", CPU=8, GPU=2)])
    # the label the cpu pool asks for is on no node
    with pytest.raises(ClusterError, match=r"pool 'cpu' \(reference x2\): .* on a node labelled \{'zone': 'a'\}"):
        check_fits(cfg, sizes, [_node("10.0.0.1", CPU=8, GPU=2), gpu_b])
    # each worker fits somewhere, but all of the actor pool's do not
    with pytest.raises(ClusterError, match=r"pool 'actor' \(policy x2, rollout x2\) needs 4 workers of "
                                           r"\{CPU: 0.25, GPU: 1\}, but its nodes hold at most 3 whole ones — lower"):
        check_fits(cfg, sizes, [gpu_a, _node("10.0.0.2", CPU=8, GPU=1, node_b=1)])
    # a colocated rollout lives in the policy's processes: it reserves nothing of its own
    check_fits(cfg, {**sizes, "rollout": 0}, [gpu_a, _node("10.0.0.2", CPU=8, GPU=0, node_b=1)])


def test_whole_workers_and_pools_sharing_nodes_are_counted():
    cfg = _cfg("cluster.pools={a: {cpus_per_worker: 2}, b: {cpus_per_worker: 2}}",
               "cluster.role_pools={policy: a, rollout: a, reward: b}", "cluster.train_ranks=2")
    two_threes = [_node("10.0.0.1", CPU=3), _node("10.0.0.2", CPU=3)]
    # pool a: three 2-CPU workers; 6 CPU in all, but each node holds one whole worker
    with pytest.raises(ClusterError, match=r"pool 'a' \(policy x2, rollout x1\) needs 3 workers of \{CPU: 2\}, "
                                           r"but its nodes hold at most 2 whole ones"):
        check_fits(cfg, {"policy": 2, "rollout": 1, "reward": 1}, two_threes)
    # each pool fits the 4-CPU node alone, the two together do not
    with pytest.raises(ClusterError, match=r"the pools need 6 CPU in all \(a 4, b 2\), but the cluster has 4"):
        check_fits(cfg, {"policy": 2, "rollout": 0, "reward": 1}, [_node("10.0.0.1", CPU=4)])
    check_fits(cfg, {"policy": 2, "rollout": 1, "reward": 1}, [_node("10.0.0.1", CPU=4), _node("10.0.0.2", CPU=4)])
