"""Snapshots of a live session: everything a step depends on, taken and restored in well under a second.

    snap = sess.snapshot()          # in the workers' host memory (to_disk=True: files in RUN_DIR/snapshots)
    sess.step(); sess.step()
    sess.restore(snap)              # back: stepping again gives bit-identical metrics and weights
    snap.release()                  # frees the memory (closing the session frees every snapshot)

What is captured, and where it stays:
- each trained role's rank (policy, critic): its own weight shards, optimizer state and RNG, copied in
  its own process (`roles/snapshots.py`): nothing is gathered or sent to the controller;
- each rollout rank: its sampling RNG and weight version (small; kept here). The engine's weights are the
  policy's, pushed again on restore;
- the controller: step count, data position, KL controller, evaluations, the config and reward function.

A checkpoint (`checkpoint.py`) is the durable, portable form; a snapshot is the fast one for a live
session's "what if" (branches.py).
"""
from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import RLBenchError, disk_full, expect, free_bytes
from .roles.rollout.base import RolloutWorker
from .roles.snapshots import SnapshotHolder

if TYPE_CHECKING:
    from .config import Config
    from .session import Session

HOLDERS = ("policy", "critic")  # roles whose workers keep their own part of a snapshot


class SnapshotError(RLBenchError, RuntimeError):
    """A snapshot that can no longer be restored (released, or its workers restarted)."""


@dataclass
class Snapshot:
    key: str
    controller: dict
    rollout_states: list
    cfg: Config
    reward_fn: Any
    holders: dict[str, tuple]       # role -> its ranks' pids when taken: a restarted role lost what it held
    bytes: int
    path: Path | None = None        # to_disk: the folder the ranks wrote into
    _session: Any = field(default=None, repr=False)

    @property
    def step(self) -> int:
        return self.controller["step"]

    @property
    def released(self) -> bool:
        return self._session is None

    def release(self) -> None:
        """Free what the workers hold for this snapshot (memory, or its files)."""
        if self._session is None:
            return
        sess, self._session = self._session, None
        sess.workers.held_snapshots.discard(self.key)
        if sess.state == "closed":
            return
        _let_go(sess, self.key, self.path)

    def __repr__(self) -> str:
        where = f"on disk in {self.path}" if self.path else "in memory"
        state = "released" if self.released else f"{self.bytes / 2**20:.1f} MiB {where}"
        return f"<Snapshot {self.key} of step {self.step}: {state}>"


def _pids(sess: Session, role: str) -> tuple:
    g = sess.groups[role]
    return tuple(g.info.get(r, {}).get("pid") for r in range(g.world_size))


def take(sess: Session, to_disk: bool = False) -> Snapshot:
    key = f"snap-{uuid.uuid4().hex[:8]}"
    path = sess.run_dir / "snapshots" / key if to_disk else None
    size = 0
    try:
        for role in HOLDERS:
            if role in sess.groups:
                size += sum(sess.groups[role].call(SnapshotHolder.hold, key, None if path is None else str(path)))
    except BaseException as e:  # a full disk, a read-only folder, no memory: the ranks that did hold their part
        _let_go(sess, key, path)  # let go, and the files written are deleted
        if path is not None and isinstance(e, Exception) and disk_full(e, path.parent):
            raise SnapshotError(f"no space left for a snapshot in {path.parent} ({free_bytes(path.parent) / 2**20:.1f}"
                                f" MiB free; {size / 2**20:.1f} MiB were written before it ran out, now deleted): "
                                "free some space, or keep it in the workers' memory with sess.snapshot()") from e
        raise
    snap = Snapshot(key=key, controller=sess.controller_state(),
                    rollout_states=sess.groups["rollout"].call(RolloutWorker.get_state), cfg=sess.cfg,
                    reward_fn=sess.reward_fn, holders={r: _pids(sess, r) for r in HOLDERS if r in sess.groups},
                    bytes=size, path=path, _session=sess)
    sess.workers.held_snapshots.add(key)
    return snap


def _let_go(sess: Session, key: str, path: Path | None) -> None:
    """What the ranks hold for `key` (memory, or files under `path`), freed; a dead worker held nothing."""
    for role in HOLDERS:
        if role in sess.groups:
            try:
                sess.groups[role].call(SnapshotHolder.release, key)
            except Exception:
                pass
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def restore(sess: Session, snap: Snapshot, history: bool = True) -> None:
    """Bring `sess` back to `snap`. `history`: rows written since move to metrics.superseded.jsonl (as a
    checkpoint load does); a branch, which wrote its rows elsewhere, passes False."""
    expect(snap, Snapshot, "sess.restore(snap)", "a snapshot from sess.snapshot()",
           "; a checkpoint is sess.load(name)" if isinstance(snap, (str, Path)) else "")
    if snap.released or snap._session is not sess:
        raise SnapshotError(f"{snap!r} cannot be restored: it was released, or belongs to another session")
    for role, pids in snap.holders.items():
        if snap.path is None and _pids(sess, role) != pids:
            raise SnapshotError(f"{snap!r} cannot be restored: the {role} workers were restarted since it was "
                                "taken, and held their part of it in memory; take snapshots with "
                                "sess.snapshot(to_disk=True) to survive a restart, or load a checkpoint")
    if snap.cfg != sess.cfg:
        sess.apply_config(snap.cfg)
    if snap.reward_fn is not sess.reward_fn:
        sess.workers.set_reward(snap.reward_fn)
    sess.guard.weights_changed()  # a branch's return comes here outside a restore phase
    for role in snap.holders:  # a restarted worker finds an on-disk snapshot by its folder
        sess.groups[role].call(SnapshotHolder.return_to, snap.key, None if snap.path is None else str(snap.path))
    sess.groups["rollout"].call_each(RolloutWorker.set_state, [(s,) for s in snap.rollout_states])
    sess.return_to(snap.controller, metrics=history)
