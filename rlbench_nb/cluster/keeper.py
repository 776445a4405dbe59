"""The keeper of a warm cluster (`rlbench-nb up`, warm.py): one detached actor on the cluster's head that keeps
`spare` warm processes ready (imports done, no role yet), hands them to sessions, remembers which run took
which (the names a detached run is found by after a kernel restart), and stops the cluster when no driver has
been connected for `idle_timeout_s`.

Taken processes are the session's: its close kills them. A session whose process died without closing (a
killed kernel) leaves them behind; the keeper kills them once Ray reports that driver's job dead, unless the
run was detached (`cluster.detached: true`): those wait for `Session.attach` (or the idle stop, or `down`).
"""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid

WARM_NAMESPACE = "rlbench-nb-warm"
KEEPER_NAME = "keeper"
TICK_S = 2.0  # how often the keeper refills, reaps and checks idleness


def is_idle(now: float, last_busy: float, idle_timeout_s: float) -> bool:
    """Whether the cluster has had no driver for `idle_timeout_s` (0: never stop)."""
    return idle_timeout_s > 0 and now - last_busy >= idle_timeout_s


def live_jobs(job_table: list[dict]) -> set[str]:
    """Job ids of the drivers still connected (kernels, scripts, `rlbench-nb up` while it waits)."""
    return {j["JobID"] for j in job_table if not j.get("IsDead")}


class Keeper:
    """Plain class; warm.up applies `ray.remote` (detached, named KEEPER_NAME in WARM_NAMESPACE)."""

    def __init__(self, spare: int, idle_timeout_s: float, refill_after_s: float, head_pid: int, info_path: str):
        self.spare_target, self.idle_timeout_s, self.refill_after_s = spare, idle_timeout_s, refill_after_s
        self.head_pid, self.info_path = head_pid, info_path
        self.spares: list = []      # warm actor handles, not yet taken
        self.taken: dict = {}       # "namespace/name" -> {"actor", "job", "detached"}
        self.last_take = 0.0
        self.last_busy = time.time()
        self.lock = threading.Lock()
        self._refill()
        threading.Thread(target=self._loop, name="keeper", daemon=True).start()

    # ---- what sessions call ---------------------------------------------------------------------
    def take(self, names: list[str], job: str, detached: bool) -> list | None:
        """Warm processes for these actor names ("namespace/name", one per rank), or None when fewer are spare."""
        with self.lock:
            if len(self.spares) < len(names):
                return None
            actors, self.spares = self.spares[:len(names)], self.spares[len(names):]
            for name, actor in zip(names, actors):
                self.taken[name] = {"actor": actor, "job": job, "detached": detached}
            self.last_take = self.last_busy = time.time()
            return actors

    def lookup(self, name: str):
        with self.lock:
            entry = self.taken.get(name)
            return entry["actor"] if entry else None

    def release(self, names: list[str]) -> None:
        """The session closed these (it killed them itself)."""
        with self.lock:
            for name in names:
                self.taken.pop(name, None)

    def status(self, wait: bool = False) -> dict:
        """Spare processes (pid, memory; `wait`: once each has finished its imports), runs holding taken ones,
        the idle timer."""
        import ray
        with self.lock:
            spares, taken = list(self.spares), dict(self.taken)
        warm = ray.get([a.warm_status.remote() for a in spares]) if wait else []
        return {"spare": len(spares), "spare_target": self.spare_target, "warm": warm,
                "runs": sorted({name.split("/", 2)[1] for name in taken if name.count("/") >= 2}),
                "idle_s": time.time() - self.last_busy, "idle_timeout_s": self.idle_timeout_s}

    # ---- the keeper's own loop ------------------------------------------------------------------
    def _refill(self) -> None:
        import ray

        from .ray_actor import WorkerActor
        actor_cls = ray.remote(WorkerActor)
        with self.lock:
            missing = self.spare_target - len(self.spares)
        for _ in range(max(missing, 0)):  # num_cpus=0: a warm process reserves nothing until a session takes it
            actor = actor_cls.options(name=f"warm/{uuid.uuid4().hex[:8]}", namespace=WARM_NAMESPACE,
                                      lifetime="detached", num_cpus=0, max_concurrency=1).remote()
            with self.lock:
                self.spares.append(actor)

    def _reap(self, alive: set[str]) -> bool:
        """Kill what sessions that died without closing left behind (not a detached run's: it is attached again).
        Whether a kernel that took processes is gone."""
        import ray
        with self.lock:
            kernel_gone = any(e["job"] not in alive for e in self.taken.values())
            gone = [n for n, e in self.taken.items() if e["job"] not in alive and not e["detached"]]
            dead = [self.taken.pop(n)["actor"] for n in gone]
        for actor in dead:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        return kernel_gone

    def _loop(self) -> None:
        import ray._private.state as ray_state  # the GCS job table: which drivers are still connected
        while True:
            time.sleep(TICK_S)
            try:
                alive = live_jobs(ray_state.state.job_table())
            except Exception:  # noqa: BLE001 - the GCS is going away: the cluster is stopping
                continue
            now = time.time()
            if alive:
                self.last_busy = now
            kernel_gone = self._reap(alive)
            if kernel_gone or now - self.last_take >= self.refill_after_s:  # a restarted kernel wants them now
                self._refill()
            if is_idle(now, self.last_busy, self.idle_timeout_s):
                self.stop()

    def stop(self) -> None:
        """Stop the whole cluster: its record first (no session joins a cluster on its way out), then the head."""
        try:
            os.remove(self.info_path)
        except OSError:
            pass
        os.kill(self.head_pid, signal.SIGTERM)
