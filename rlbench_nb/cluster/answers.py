"""How a Ray worker group waits for its ranks' answers, by Ray reference or by channel (channel.py): results by
rank, the first failure in whatever rank raised at once and named by role, rank and method, a dead process named
as such (and a rank that lost its peer naming the peer that died, not its own symptom)."""
from __future__ import annotations

import time
from typing import Any

from . import channel
from .channel import ChannelCall, ChannelClosed
from .errors import OOM_KNOBS, ClusterError, WorkerDiedError, WorkerError, is_out_of_memory
from .ray_connect import lost_cluster_error

# How long a rank's lost connection waits for Ray to report the peer that died (Ray notices a killed
# actor within about a second; gloo notices the closed socket at once).
PEER_GRACE_S = 10.0
# What torch.distributed says when a peer's process is gone mid-collective (gloo on CPU, NCCL on GPU).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed",
              "NCCL communicator was aborted", "remote process exited")


def _lost_a_peer(message: str) -> bool:
    return any(s.lower() in message.lower() for s in _PEER_LOST)


class Answers:
    """What RayWorkerGroup waits with; it sets `role`, `timeout`, `actors`, `info` and `memory`."""

    def _get(self, refs: list, method: str) -> list:
        """Results by rank; the first failure (in whatever rank) is raised at once, naming that rank. When
        a rank failed because it lost its connection to a peer, the peer's death is the cause: give the
        other ranks PEER_GRACE_S to be reported dead and name the dead one instead."""
        if refs and isinstance(refs[0], ChannelCall):
            return self._get_answers(refs, method)
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        index = {ref: r for r, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending, deadline = list(refs), time.time() + self.timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.time(), 0))
            if not ready:
                ranks = sorted(index[p] for p in pending)
                raise WorkerError(self.role, ranks[0], method, f"no answer within cluster.call_timeout_s="
                                  f"{self.timeout:.0f}s from rank(s) {ranks} (hung, or waiting on a dead peer)")
            rank = index[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayTaskError as e:
                error = self._task_error(e, rank, method)
                if pending and _lost_a_peer(str(e)):
                    died = self._first_death(pending, index, method)
                    if died is not None:
                        raise died from None
                raise error from None
            except RayActorError as e:
                raise self._death(e, rank, method) from None
        return [results[r] for r in range(len(refs))]

    def _task_error(self, e, rank: int, method: str) -> WorkerError:
        cause = getattr(e, "cause", None)
        if isinstance(cause, WorkerError):
            return WorkerError(cause.role, cause.rank, cause.method, cause.summary, cause.frame,
                               cause.remote_traceback)
        return WorkerError(self.role, rank, method, str(e).splitlines()[-1], None, str(e))

    def _death(self, e, rank: int, method: str) -> ClusterError | WorkerDiedError:
        lost = lost_cluster_error()
        if lost is not None:
            return lost
        last = self.memory.get(rank, {})
        oom = (f" It ran out of memory (last reported {last.get('rss_gb', 0.0):.2f} GB resident): "
               f"{OOM_KNOBS}.") if is_out_of_memory(e) else ""
        back = " (from the last checkpoint; none saved: a new session)" if self.role in ("policy", "critic") else ""
        return WorkerDiedError(self.role, rank, method, f"the worker process died (pid "
                               f"{self.info.get(rank, {}).get('pid', '?')}): {str(e).splitlines()[0]}.{oom} "
                               f"Restart the role with sess.restart('{self.role}'){back}, or run(..., "
                               f"on_failure='restore')")

    def _first_death(self, pending: list, index: dict, method: str) -> ClusterError | WorkerDiedError | None:
        """The death of one of the `pending` ranks, if Ray reports it within PEER_GRACE_S."""
        import ray
        from ray.exceptions import RayActorError
        deadline = time.time() + PEER_GRACE_S
        while pending and time.time() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.time(), 0))
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as e:
                    return self._death(e, index[ref], method)
                except Exception:  # noqa: BLE001 - another peer's own error: keep waiting for a death
                    pass
        return None

    def _get_answers(self, calls: list[ChannelCall], method: str) -> list:
        """`_get` for calls sent by channel: the first failure, in whatever rank, raised at once; a channel that
        closes is its rank's death (and a rank that lost its peer names the peer whose channel closed)."""
        results, pending, deadline = {}, dict(enumerate(calls)), time.time() + self.timeout
        while pending:
            ranks = list(pending)
            try:
                first = channel.wait_first([pending[r] for r in ranks], max(deadline - time.time(), 0))
            except ChannelClosed as e:
                raise self._closed(ranks[e.index], method) from None
            if first is None:
                raise WorkerError(self.role, ranks[0], method, f"no answer within cluster.call_timeout_s="
                                  f"{self.timeout:.0f}s from rank(s) {ranks} (hung, or waiting on a dead peer)")
            rank, ok, value = ranks[first[0]], first[1], first[2]
            del pending[rank]
            if ok:
                results[rank] = value
                continue
            error = value if isinstance(value, WorkerError) else WorkerError(
                self.role, rank, method, f"{type(value).__name__}: {value}")
            if pending and _lost_a_peer(str(error)):
                died = self._first_closed(pending, method)
                if died is not None:
                    raise died from None
            raise error from None
        return [results[r] for r in range(len(calls))]

    def _first_closed(self, pending: dict, method: str) -> Exception | None:
        """The death of one of the `pending` ranks, if its channel closes within PEER_GRACE_S."""
        deadline = time.time() + PEER_GRACE_S
        while pending and time.time() < deadline:
            ranks = list(pending)
            try:
                first = channel.wait_first([pending[r] for r in ranks], max(deadline - time.time(), 0))
            except ChannelClosed as e:
                return self._closed(ranks[e.index], method)
            if first is None:
                return None
            del pending[ranks[first[0]]]
        return None

    def _closed(self, rank: int, method: str) -> Exception:
        """A rank's channel closed before its answer: its process died (named as Ray reports the death), or
        another controller attached to the worker and took the channel over."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError
        try:
            ray.get(self.actors[rank].get_meta.remote(), timeout=PEER_GRACE_S)
        except RayActorError as e:
            return self._death(e, rank, method)
        except GetTimeoutError:
            pass
        return WorkerError(self.role, rank, method, "its call channel closed while the worker lives: another "
                           "controller attached to this run's workers and now drives them; close this session")
