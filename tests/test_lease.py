"""rundir.Lease, the one-writer-per-run fence: a phase's check costs a stat while the file is this controller's own
write, and every write of the run reads the file first, whatever its signature says."""
from __future__ import annotations

import json

import pytest

from rlbench_nb.errors import SessionStateError
from rlbench_nb.rundir import Lease


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


def test_a_lease_renewed_during_the_update_is_only_checked_when_the_step_records(tmp_path):
    """Session._train renews the lease while the trainers work (renew_ahead); the step's own renew then writes
    nothing, but still reads the file: a take-over in between stops the step's record. A renewal that could
    not happen ahead is the step's own to do, and to fail."""
    mine = Lease(tmp_path)
    mine.acquire()

    def renewed() -> float:
        return json.loads((tmp_path / "owner.json").read_text())["renewed"]
    before = renewed()
    mine.renew_ahead()
    ahead = renewed()
    assert ahead > before
    mine.renew()  # the step's record: checked, not written again
    assert renewed() == ahead
    mine.renew()  # the next step, without a renewal ahead, writes again
    assert renewed() > ahead
    mine.renew_ahead()
    Lease(tmp_path).acquire(take_over=True)
    with pytest.raises(SessionStateError, match="cannot renew the run's lease"):
        mine.renew()  # taken over after its renewal ahead: the step records nothing
    other = Lease(tmp_path / "gone")  # a directory that is not there: every write fails
    other.renew_ahead()  # quietly: the update goes on ...
    with pytest.raises(OSError, match="owner.json"):
        other.renew(since=1.0)  # ... and the write that belongs to the step says why
