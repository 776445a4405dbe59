"""What every step writes to the run directory besides its row: rundir.Lease, the one-writer-per-run fence (a
phase's check costs a stat while the file is this controller's own write, and every write of the run reads the file
first, whatever its signature says), and controller_state.json."""
from __future__ import annotations

import errno
import json
import os

import pytest

from rlbench_nb.errors import RunDirError, SessionStateError
from rlbench_nb.rundir import RENEW_EVERY_S, Lease, overwrite_json


def test_phase_checks_skip_the_read_while_the_lease_is_unchanged_and_see_a_takeover_at_once(tmp_path, monkeypatch):
    mine = Lease(tmp_path)
    mine.acquire()
    reads = []
    real_holder = Lease.holder
    monkeypatch.setattr(Lease, "holder", lambda self: reads.append(1) or real_holder(self))
    for _ in range(5):
        mine.check("rollout")
    assert reads == []  # the file is as this controller wrote it: no read
    taker = Lease(tmp_path)
    taker.acquire(take_over=True)
    with pytest.raises(SessionStateError, match="cannot rollout: run directory .* was taken over by another session"):
        mine.check("rollout")
    assert taker.holds() and not mine.holds()


def test_renew_reads_the_file_even_when_its_signature_looks_like_its_own_write(tmp_path):
    """A network file system can show a stale signature for a while: a phase's check may miss the take-over, the
    write after the step may not (it would take the run back from its new holder)."""
    mine, taker = Lease(tmp_path), Lease(tmp_path)
    mine.acquire()
    taker.acquire(take_over=True)
    mine._mine = mine._signature()  # what a stale stat would show: the taker's file passing for this one's own
    mine.check("rollout")  # the cheap check is fooled ...
    with pytest.raises(SessionStateError, match="cannot renew the run's lease"):
        mine.renew()  # ... the write's is not
    assert json.loads((tmp_path / "owner.json").read_text())["token"] == taker.token
    mine.release()  # reads too: the taker's file stays
    assert (tmp_path / "owner.json").exists() and taker.holds()


def test_every_step_reads_the_lease_and_rewrites_it_only_when_its_time_is_due(tmp_path):
    """Only a holder on another machine is judged by its lease's time, over LEASE_TTL_S: the step's renew reads the
    file every time (a take-over stops the step's record) but writes it only once its last write is RENEW_EVERY_S
    old. A write that fails says which file."""
    mine = Lease(tmp_path)
    mine.acquire()

    def renewed() -> float:
        return json.loads((tmp_path / "owner.json").read_text())["renewed"]
    first = renewed()
    reads = []
    real_holder = Lease.holder
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Lease, "holder", lambda self: reads.append(1) or real_holder(self))
        for _ in range(3):
            mine.renew()
    assert reads == [1, 1, 1] and renewed() == first  # read each time, not written
    mine._written -= RENEW_EVERY_S  # as if RENEW_EVERY_S had passed
    mine.renew()
    assert renewed() > first
    Lease(tmp_path).acquire(take_over=True)
    with pytest.raises(SessionStateError, match="cannot renew the run's lease"):
        mine.renew()  # taken over, and no write due: the step records nothing
    with pytest.raises(OSError, match="owner.json"):
        Lease(tmp_path / "gone").acquire()  # a directory that is not there


def test_controller_state_is_rewritten_in_place_while_it_fits_and_replaced_when_it_grows(tmp_path):
    """controller_state.json after every step: one write over the file (same inode, padded with spaces, which JSON
    ignores), no rename (~0.15-0.6 ms a step on ext4); a state that outgrows the file replaces it, padded to 4 KiB."""
    path = tmp_path / "controller_state.json"
    overwrite_json(path, {"step": 1, "evals": []})
    inode, size = path.stat().st_ino, path.stat().st_size
    assert size == 4096 and json.loads(path.read_text()) == {"step": 1, "evals": []}
    overwrite_json(path, {"step": 22, "kl": 0.123456789})
    assert (path.stat().st_ino, path.stat().st_size) == (inode, size)
    assert json.loads(path.read_text()) == {"step": 22, "kl": 0.123456789}
    overwrite_json(path, {"step": 2})  # shorter: the rest is spaces
    assert json.loads(path.read_text()) == {"step": 2} and path.stat().st_size == size
    big = {"step": 3, "evals": [{"step": i, "eval/accuracy": 0.5} for i in range(200)]}
    overwrite_json(path, big)
    assert path.stat().st_ino != inode and path.stat().st_size % 4096 == 0 and json.loads(path.read_text()) == big
    def full(*_):
        raise OSError(errno.EIO, "Input/output error")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "pwrite", full)
        with pytest.raises(RunDirError, match="controller_state.json.*Input/output error"):
            overwrite_json(path, {"step": 4})
    assert json.loads(path.read_text()) == big  # nothing lost
