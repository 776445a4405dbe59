"""channel.py, worker calls over a Unix socket: a real server thread and real sockets in this process (the Ray
actor that hosts a server in production is tests/cluster/test_ray_backend.py's)."""
from __future__ import annotations

import os
import threading
import time

import pytest

from rlbench_nb.cluster import channel
from rlbench_nb.cluster.channel import ChannelCall, ChannelClosed, ChannelServer, wait_first


def _server(handle):
    server = ChannelServer(handle)
    yield server
    server.close()


@pytest.fixture
def echo():
    """A server answering (seconds, value) with value after sleeping seconds; "raise" raises, "lambda" cannot
    be pickled back."""
    def handle(request):
        seconds, value = request
        time.sleep(seconds)
        if value == "raise":
            raise ValueError("the worker's own error")
        return (lambda: 0) if value == "lambda" else value
    yield from _server(handle)


def _call(ch, request) -> ChannelCall:
    return ChannelCall(ch, ch.send(request))


def test_answers_come_back_to_their_own_calls_in_order(echo):
    ch = channel.connect(echo.path)
    try:
        slow, fast = _call(ch, (0.2, "slow")), _call(ch, (0.0, "fast"))
        assert wait_first([fast], 5.0) == (0, True, "fast")  # answered in order: fast waited behind slow
        assert slow.take() == (True, "slow")  # read off the socket while waiting for fast, kept for its own call
        abandoned = _call(ch, (0.1, "nobody waits"))  # an interrupted cell's call: its answer must not leak
        after = _call(ch, (0.0, "mine"))
        assert wait_first([after], 5.0) == (0, True, "mine")
        assert abandoned.take() == (True, "nobody waits")
    finally:
        channel.disconnect(echo.path)


def test_a_workers_error_and_an_answer_that_cannot_travel_come_back_as_errors(echo):
    ch = channel.connect(echo.path)
    try:
        _, ok, error = wait_first([_call(ch, (0.0, "raise"))], 5.0)
        assert not ok and isinstance(error, ValueError) and "the worker's own error" in str(error)
        _, ok, error = wait_first([_call(ch, (0.0, "lambda"))], 5.0)
        assert not ok and "could not be sent back" in str(error)
        assert wait_first([_call(ch, (0.0, 7))], 5.0) == (0, True, 7)  # the channel still works
    finally:
        channel.disconnect(echo.path)


def test_the_first_answer_of_several_channels_wins_and_a_silent_one_times_out(echo):
    other = ChannelServer(lambda request: time.sleep(request) or request)
    a, b = channel.connect(echo.path), channel.connect(other.path)
    try:
        calls = [_call(a, (1.0, "late")), _call(b, 0.05)]
        assert wait_first(calls, 5.0) == (1, True, 0.05)
        t0 = time.monotonic()
        assert wait_first([_call(b, 2.0)], 0.3) is None  # no answer within the timeout: None, after ~0.3 s
        assert 0.25 < time.monotonic() - t0 < 1.5
    finally:
        channel.disconnect(echo.path)
        channel.disconnect(other.path)
        other.close()


def test_a_second_controller_takes_the_channel_over_and_a_closed_server_is_seen(echo):
    import socket
    first = channel.connect(echo.path)
    assert channel.connect(echo.path) is first  # one channel per server in a process (roles sharing an actor)
    pending = _call(first, (0.5, "to the first"))
    time.sleep(0.1)
    second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    second.connect(echo.path)  # another process's controller (a restarted kernel attaching the run)
    taken = channel.Channel(second, echo.path)
    try:
        with pytest.raises(ChannelClosed):
            wait_first([pending], 5.0)  # the first controller learns it no longer drives the worker
        assert wait_first([_call(taken, (0.0, "to the second"))], 5.0) == (0, True, "to the second")
        echo.close()
        assert not os.path.exists(echo.dir)  # the socket's private directory goes with the server
        with pytest.raises(ChannelClosed):
            wait_first([_call(taken, (0.0, "after close"))], 5.0)
    finally:
        channel.disconnect(echo.path)
        taken.close()


def test_a_path_nobody_listens_on_gives_no_channel(tmp_path):
    assert channel.connect(str(tmp_path / "nothing")) is None  # another machine's socket: calls go by Ray
    assert channel.connect(None) is None


def test_two_threads_of_one_controller_each_get_their_own_answer(echo):
    ch = channel.connect(echo.path)
    got = {}

    def ask(name):
        got[name] = wait_first([_call(ch, (0.01, name))], 10.0)

    try:
        threads = [threading.Thread(target=ask, args=(f"t{i}",)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == {f"t{i}": (0, True, f"t{i}") for i in range(8)}
    finally:
        channel.disconnect(echo.path)


def test_a_server_removes_the_socket_directories_of_processes_that_are_gone(tmp_path, monkeypatch):
    """An actor killed never closes its server: the next server started on the machine removes the directory the
    dead process left, and no other (a live process's, a name it did not make)."""
    import subprocess
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    left = tmp_path / f"rlbench-nb-calls-{dead.pid}-abc"
    live = tmp_path / f"rlbench-nb-calls-{os.getpid()}-def"
    other = tmp_path / "rlbench-nb-calls-notapid-x"
    for d in (left, live, other):
        d.mkdir()
    server = ChannelServer(lambda request: request)
    try:
        assert not left.exists() and live.exists() and other.exists()
        assert os.path.basename(server.dir).startswith(f"rlbench-nb-calls-{os.getpid()}-")
    finally:
        server.close()
    assert not os.path.exists(server.dir)


def test_a_directory_gone_between_the_listing_and_its_check_does_not_stop_a_server(tmp_path, monkeypatch):
    """Actors start side by side and each sweeps: one listed a dead process's directory that another removed (or a
    server closing removed its own) before the check. Found as a rollout actor dying in __init__ with
    FileNotFoundError while benchmarks/controller_overhead.py started its next session."""
    import glob
    import subprocess
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f"rlbench-nb-calls-{dead.pid}-abc"
    left.mkdir()
    listed = glob.glob(str(tmp_path / "rlbench-nb-calls-*-*")) + [str(tmp_path / f"rlbench-nb-calls-{dead.pid}-gone")]
    monkeypatch.setattr(glob, "glob", lambda pattern: listed)  # the listing still names a directory now removed
    server = ChannelServer(lambda request: request)
    try:
        assert not left.exists()  # the sweep went on past the vanished one
    finally:
        server.close()
