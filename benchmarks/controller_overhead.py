"""Controller overhead per backend: start-up, empty call round trip, weight sync, and its share of a step.

    python benchmarks/controller_overhead.py            # local, ray, ray-tasks (cluster.channels=false), ray-colocated
    python benchmarks/controller_overhead.py --calls 20 --steps 30 --json out.json

`empty call`: a worker method that does nothing but report memory, called on every rank of the policy
group (median over --calls). `sync`: policy -> rollout weight push, against a plain in-process copy of
the same tensors. `overhead %`: over --steps GRPO steps of the tiny config (the issue's yardstick: 8
prompts x 8 samples, <= 8 new tokens), the share of each step's wall time not spent inside a worker
method: dispatch, (de)serialisation, the controller's own bookkeeping (decode, advantages, metrics).
`serial ms`: the part of a step with no worker call in flight, the controller's own Python on its path; `in flight
ms`: the rest of the overhead, calls on their way with no worker method running (pickling, sockets, wake-ups, the
weight store).
`floors` (Ray backends that push to another actor): the same step's calls on bare Ray actors that only spin
for each call's measured median seconds, with nothing in between — what the transport alone costs on this
machine, in the same run — as Ray tasks (`ray tasks`), with the fewest round trips tasks allow (`fewest`), over
Ray compiled graphs (`compiled`) and over channels (`channels`, the session's way on one machine), with the CPU
the idle actors use (`idle cores`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import transformers

import rlbench_nb as rl

BACKENDS = {"local": ["cluster.backend=local"], "ray": ["cluster.backend=ray"],
            "ray-tasks": ["cluster.backend=ray", "cluster.channels=false"],  # every call a Ray task, as before
            "ray-colocated": ["cluster.backend=ray", "rollout.colocate=true"]}
TINY = ["data.batch_size=8", "rollout.n=8", "rollout.max_new_tokens=8", "algo.reuse_logprobs=true",
        "train.micro_batch_size=4096", "run.save_rollouts_every=0", "cluster.num_threads=2"]


def step_overhead(sess, steps: int) -> tuple[float, float, float, dict, float]:
    """(median step seconds, median share of it outside worker methods, median seconds with no worker call in
    flight — the controller's own Python on the step's path —, (role, method) -> median seconds inside it,
    median seconds of the rest of the overhead: calls in flight with no worker method running)."""
    walls, shares, serials, flights, works = [], [], [], [], {}
    for i in range(steps + 3):
        t0 = time.perf_counter()
        sess.step()
        t1 = time.perf_counter()
        if i < 3:
            continue  # warm-up
        calls = {}  # (role, method, start) -> slowest rank's seconds inside the method
        spans = []
        for g in sess.groups.values():
            for r in g.records:
                if r.start >= t0:
                    key = (r.role, r.method, r.start)
                    calls[key] = max(calls.get(key, 0.0), r.work_s)
                    spans.append((r.start, min(r.end, t1)))
        for (role, method, _), work_s in calls.items():
            works.setdefault((role, method), []).append(work_s)
        inside = sum(calls.values())
        walls.append(t1 - t0)
        shares.append(max(0.0, (t1 - t0 - inside) / (t1 - t0)))
        serials.append(t1 - t0 - covered(spans))
        flights.append(t1 - t0 - inside - serials[-1])
    return (statistics.median(walls), statistics.median(shares), statistics.median(serials),
            {k: statistics.median(v) for k, v in works.items()}, statistics.median(flights))


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds inside the union of the (start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Spinner:
    """A bare actor: holds a core for the seconds it is told, returns nothing of size."""

    def spin(self, seconds: float, *_deps) -> int:
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass
        return 0

    def spin_twice(self, first: float, second: float) -> tuple[int, int]:
        """Two calls' work in one task, two returns (the update and the weights read after it)."""
        return self.spin(first), self.spin(second)

    def serve(self) -> str:
        """A channel server (rlbench_nb/cluster/channel.py) spinning for the seconds each request says."""
        from rlbench_nb.cluster.channel import ChannelServer
        self.server = ChannelServer(self.spin)
        return self.server.path

    def cpu_seconds(self) -> float:
        t = os.times()
        return t.user + t.system


def ray_floors(works: dict, steps: int) -> dict:
    """pattern -> (median step seconds, share outside the calls, cores the idle actors burn) on bare actors:
    `ray tasks` the step's calls as Ray actor tasks (generate, score, update with the weight read queued behind it
    and the engine's load queued on that read's result); `fewest` the fewest round trips those calls allow as
    tasks (score queued on generate's result, the update and the weight read as one task); `compiled` the tasks
    over Ray compiled graphs (one per actor, shared-memory channels); `channels` the calls over each actor's
    socket (cluster/channel.py), the way the session sends them on one machine (cluster.channels)."""
    import ray
    from ray.dag import InputNode
    w = {k[1]: v for k, v in works.items()}
    inside = w["generate"] + w["score"] + w["update"] + w["get_weights"] + w["set_weights"]
    rollout, reward, policy = actors = [ray.remote(Spinner).options(num_cpus=0).remote() for _ in range(3)]

    def ray_tasks():
        ray.get(rollout.spin.remote(w["generate"]))
        ray.get(reward.spin.remote(w["score"]))
        update, weights = policy.spin.remote(w["update"]), policy.spin.remote(w["get_weights"])
        ray.get([update, weights, rollout.spin.remote(w["set_weights"], weights)])

    def fewest():
        generated = rollout.spin.remote(w["generate"])
        ray.get([generated, reward.spin.remote(w["score"], generated)])
        update, weights = policy.spin_twice.options(num_returns=2).remote(w["update"], w["get_weights"])
        ray.get([update, rollout.spin.remote(w["set_weights"], weights)])

    graphs = []
    for a in actors:
        with InputNode() as seconds:
            graphs.append(a.spin.bind(seconds).experimental_compile())
    g_rollout, g_reward, g_policy = graphs

    def compiled():  # a compiled graph's result cannot be another graph's argument: the controller passes it on
        ray.get(g_rollout.execute(w["generate"]))
        ray.get(g_reward.execute(w["score"]))
        update, weights = g_policy.execute(w["update"]), g_policy.execute(w["get_weights"])
        ray.get(update), ray.get(weights)
        ray.get(g_rollout.execute(w["set_weights"]))

    from rlbench_nb.cluster.channel import ChannelCall, connect, disconnect, wait_first
    paths = ray.get([a.serve.remote() for a in actors])
    c_rollout, c_reward, c_policy = (connect(p) for p in paths)

    def channels():  # the session's way on one machine: the same calls over each actor's socket
        def call(ch, seconds):
            return ChannelCall(ch, ch.send(seconds))
        wait_first([call(c_rollout, w["generate"])], 60)
        wait_first([call(c_reward, w["score"])], 60)
        update, weights = call(c_policy, w["update"]), call(c_policy, w["get_weights"])
        wait_first([update], 60), wait_first([weights], 60)
        wait_first([call(c_rollout, w["set_weights"])], 60)

    out = {}
    for name, step in (("ray tasks", ray_tasks), ("fewest", fewest), ("compiled", compiled),
                       ("channels", channels)):
        walls = []
        for _ in range(steps + 3):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls[3:])
        out[name] = [wall, max(0.0, (wall - inside) / wall), 0.0]
    out["compiled"][2] = idle_cores(actors)  # compiled graphs' actors wait for their next call by polling
    for g in graphs:
        g.teardown()
    out["ray tasks"][2] = out["channels"][2] = idle_cores(actors)  # a channel's server thread blocks on its socket
    for p in paths:
        disconnect(p)
    for a in actors:
        ray.kill(a)
    return out


def idle_cores(actors, seconds: float = 2.0) -> float:
    """CPU cores the actors use between calls (a process blocked on its next call uses none)."""
    import ray
    before = sum(ray.get([a.cpu_seconds.remote() for a in actors]))
    time.sleep(seconds)
    return (sum(ray.get([a.cpu_seconds.remote() for a in actors])) - before) / seconds


def measure(backend: str, calls: int, steps: int) -> dict:
    cfg = rl.Config.load(None, [f"run.dir={tempfile.mkdtemp()}", "run.tensorboard=false", "task.num_test=20",
                                *BACKENDS[backend], *TINY])
    t0 = time.perf_counter()
    if cfg.cluster.backend == "ray":
        from rlbench_nb.cluster.ray_connect import attach
        attach(cfg)
    cluster_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sess = rl.Session(cfg)
    session_s = time.perf_counter() - t0
    group = sess.groups["policy"]
    group.call("memory")
    rtt = []
    for _ in range(calls):
        t = time.perf_counter()
        group.call("memory")
        rtt.append(time.perf_counter() - t)
    syncs = [sess.sync_weights() for _ in range(5)]
    sync_s = statistics.median(s["sync/s"] for s in syncs)
    weights = sess.groups["policy"].call("get_weights")[0]
    t = time.perf_counter()
    for _ in range(5):
        {k: v.clone() for k, v in weights.items()}
    copy_s = (time.perf_counter() - t) / 5
    step_s, share, serial_s, works, flight_s = step_overhead(sess, steps)
    pushes = sess.groups["policy"].last_transport != "here" if cfg.cluster.backend == "ray" else False
    sess.close()
    nbytes = syncs[0]["sync/bytes"]
    floors = ray_floors(works, steps) if pushes else {}
    return {"backend": backend, "cluster_start_s": cluster_s, "session_start_s": session_s,
            "empty_call_ms": 1e3 * statistics.median(rtt), "sync_s": sync_s, "sync_MB_s": nbytes / sync_s / 1e6,
            "copy_MB_s": nbytes / copy_s / 1e6, "bytes": nbytes, "step_s": step_s, "overhead_share": share,
            "serial_s": serial_s, "in_flight_s": flight_s, "floors": floors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--json")
    args = p.parse_args()
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    rows = [measure(b, args.calls, args.steps) for b in args.backends]
    print(f"\n{'backend':<14} {'cluster s':>9} {'session s':>9} {'empty call ms':>13} {'sync ms':>8} "
          f"{'sync MB/s':>9} {'copy MB/s':>9} {'step ms':>8} {'overhead %':>10} {'serial ms':>9} {'in flight ms':>12}")
    for r in rows:
        print(f"{r['backend']:<14} {r['cluster_start_s']:>9.1f} {r['session_start_s']:>9.1f} "
              f"{r['empty_call_ms']:>13.2f} {1e3 * r['sync_s']:>8.1f} {r['sync_MB_s']:>9.0f} {r['copy_MB_s']:>9.0f} "
              f"{1e3 * r['step_s']:>8.1f} {100 * r['overhead_share']:>9.0f}% {1e3 * r['serial_s']:>9.1f} "
              f"{1e3 * r['in_flight_s']:>12.1f}")
    for r in rows:
        if r["floors"]:
            print(f"\nfloors of the {r['backend']} step: its calls on bare actors that spin for each call's "
                  f"median seconds inside\n{'pattern':<12} {'step ms':>8} {'overhead %':>10} {'idle cores':>10}")
            for name, (wall, share, idle) in r["floors"].items():
                print(f"{name:<12} {1e3 * wall:>8.1f} {100 * share:>9.0f}% {idle:>10.2f}")
    print(f"weights: {rows[0]['bytes'] / 1e6:.1f} MB; step: tiny config, 64 completions x <= 8 tokens")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
