"""The warm cluster's rules that need no cluster: when the keeper stops it, which drivers count, which roles may
take a warm process, and a record whose head is gone."""
import json
import socket

from rlbench_nb.cluster import warm
from rlbench_nb.cluster.keeper import is_idle, live_jobs
from rlbench_nb.cluster.pools import placement
from rlbench_nb.config import Config


def test_idle_means_no_driver_for_the_whole_timeout_and_zero_means_never():
    assert not is_idle(now=100.0, last_busy=90.0, idle_timeout_s=30.0)
    assert is_idle(now=120.0, last_busy=90.0, idle_timeout_s=30.0)  # exactly the timeout: stop
    assert not is_idle(now=1e9, last_busy=0.0, idle_timeout_s=0.0)


def test_live_jobs_are_the_drivers_ray_has_not_marked_dead():
    table = [{"JobID": "01000000", "IsDead": True}, {"JobID": "02000000", "IsDead": False}, {"JobID": "03000000"}]
    assert live_jobs(table) == {"02000000", "03000000"}


def test_only_a_default_pool_cpu_share_takes_a_warm_process():
    base = []  # placement reads cluster.pools / role_pools and the per-worker shares, whatever the backend
    assert warm.fits(placement(Config.load(None, base), "policy"))
    assert not warm.fits(placement(Config.load(None, [*base, "cluster.gpus_per_worker=1"]), "policy"))
    pools = Config.load(None, [*base, "cluster.pools={cpu: {cpus_per_worker: 1}, tagged: {resources: {x: 1}}}",
                               "cluster.role_pools={policy: cpu, rollout: tagged, reward: cpu}"])
    assert not warm.fits(placement(pools, "policy"))  # a named pool: its own reservation
    assert not warm.fits(placement(pools, "rollout"))


def test_a_record_whose_head_is_gone_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBENCH_NB_HOME", str(tmp_path))
    assert warm.running() is None and warm.down() is None  # none recorded
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "cluster.json").write_text(json.dumps({"address": f"127.0.0.1:{port}", "head_pid": 1,
                                                       "temp_dir": str(tmp_path / "ray")}))
    assert warm.running() is None
    assert not (tmp_path / "cluster.json").exists()
