"""Worker calls over a Unix socket, for a controller on the same machine as the worker's actor.

A Ray actor call costs ~1-2 ms of hand-offs on a busy 2-core machine (the submit, the core workers, the reply);
the same call written to a socket the actor's process listens on costs ~0.1 ms (benchmarks/README.md "Worker
calls over a socket"). Ray still starts, places, names and kills the processes and carries every call where no socket
reaches (another node); only the calls themselves take the short way, answered in the order they were sent.

    server = ChannelServer(handle)            # in the actor: a thread answering handle(request), one at a time
    channel = connect(server.path)            # in the controller: None where the path is not on this machine
    call = ChannelCall(channel, channel.send(request))
    first = wait_first([call, ...], timeout)  # (index, ok, value) of whichever answer comes first

A socket is a file in a directory only its user may enter. A second controller connecting (a restarted kernel
attaching a detached run) takes the channel over: the first one's connection is closed.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pickle
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("!Q")
_DIR_PREFIX = "rlbench-nb-calls-"  # + pid-random: a server's socket directory in the temporary folder


def _remove_dead_servers_dirs() -> None:
    """The socket directories of servers whose process is gone (an actor killed never closes its server)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_DIR_PREFIX}*-*")):
        pid = os.path.basename(path)[len(_DIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            owner = os.stat(path).st_uid
        except FileNotFoundError:  # gone since the listing: a server closed, or another actor starting swept it
            continue
        if owner != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive, another user's
            pass


def write_frame(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def read_frame(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    return pickle.loads(_read_exactly(sock, size))


def _read_exactly(sock: socket.socket, n: int) -> bytearray:
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the channel was closed")
        got += k
    return buf


class ChannelServer:
    """The actor's end: a listening socket, and a thread per connection answering `handle(request)` in order."""

    def __init__(self, handle: Callable[[Any], Any]):
        self.handle = handle
        _remove_dead_servers_dirs()
        # mode 0700: only this user connects; the pid in the name: a process killed without closing is found later
        self.dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        self.path = os.path.join(self.dir, "socket")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(4)
        self.conn: socket.socket | None = None
        threading.Thread(target=self._accept, name="rlbench-nb channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            old, self.conn = self.conn, conn
            if old is not None:  # a new controller takes over: the old connection's reader sees it closed
                with contextlib.suppress(OSError):
                    old.shutdown(socket.SHUT_RDWR)
            threading.Thread(target=self._serve, args=(conn,), name="rlbench-nb calls", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                call_id, request = read_frame(conn)
                try:
                    reply = (call_id, True, self.handle(request))
                except Exception as e:  # noqa: BLE001 - the worker's own error goes back to the controller
                    reply = (call_id, False, e)
                try:
                    write_frame(conn, reply)
                except (pickle.PicklingError, TypeError, AttributeError) as e:  # a result that cannot travel
                    write_frame(conn, (call_id, False, RuntimeError(f"the answer could not be sent back: {e}")))
        conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.shutdown(socket.SHUT_RDWR)
        shutil.rmtree(self.dir, ignore_errors=True)


class Channel:
    """The controller's end of one actor's socket: requests numbered as sent, answers kept by number until
    asked for (an answer nobody waited for, after an interrupt, does not become the next call's)."""

    def __init__(self, sock: socket.socket, path: str):
        self.sock, self.path = sock, path
        self.next_id = 0
        self.replies: dict[int, tuple[bool, Any]] = {}
        self.closed = False
        self._send_lock, self._read_lock = threading.Lock(), threading.Lock()

    def send(self, request: Any) -> int:
        with self._send_lock:
            self.next_id += 1
            try:
                write_frame(self.sock, (self.next_id, request))
            except OSError:
                self.closed = True  # the answer's wait reports it (a dead process, or a channel taken over)
            return self.next_id

    def read_available(self) -> None:
        """Every answer that has arrived, into `replies`; `closed` once the other end is gone."""
        with self._read_lock:
            try:
                while not self.closed and select.select([self.sock], [], [], 0)[0]:
                    call_id, ok, value = read_frame(self.sock)
                    self.replies[call_id] = (ok, value)
            except (EOFError, OSError, ValueError):
                self.closed = True

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


class ChannelCall:
    """One sent call: its answer, once fetched, stays here (a stored call's status and result read it twice)."""

    def __init__(self, channel: Channel, call_id: int, part: int | None = None, whole: ChannelCall | None = None):
        self.channel, self.call_id, self.part, self.whole = channel, call_id, part, whole
        self.answer: tuple[bool, Any] | None = None

    def take(self) -> tuple[bool, Any] | None:
        """(ok, value) if the answer is in, else None."""
        if self.whole is not None:
            got = self.whole.take()
            return got if got is None or not got[0] else (True, got[1][self.part])
        if self.answer is None and self.call_id in self.channel.replies:
            self.answer = self.channel.replies.pop(self.call_id)
        return self.answer

    @classmethod
    def answered(cls, ok: bool, value: Any) -> ChannelCall:
        """A call that needs no sending: its answer is known (a call that cannot be made fails with this)."""
        call = cls(None, 0)  # type: ignore[arg-type]
        call.answer = (ok, value)
        return call

    def of(self, part: int) -> ChannelCall:
        """Part `part` of this call's answer (a tuple) as a call of its own."""
        return ChannelCall(self.channel, self.call_id, part, whole=self)


class ChannelClosed(Exception):
    """The channel of the call at `index` closed before its answer came."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


def wait_first(calls: list[ChannelCall], timeout: float) -> tuple[int, bool, Any] | None:
    """(index, ok, value) of the first of `calls` answered, None after `timeout` seconds; ChannelClosed(index)
    when a call's channel closes first."""
    deadline = time.monotonic() + timeout
    while True:
        for i, call in enumerate(calls):
            got = call.take()
            if got is not None:
                return i, got[0], got[1]
            if call.channel.closed:
                raise ChannelClosed(i)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        channels = {id(c.channel): c.channel for c in calls}.values()
        try:  # in slices: another thread of this controller may read this answer off the socket meanwhile
            ready = select.select([ch.sock for ch in channels], [], [], min(remaining, 0.5))[0]
        except (ValueError, OSError):  # a socket closed under this wait (the session closing)
            ready = [ch.sock for ch in channels]
        for ch in channels:
            if ch.sock in ready:
                ch.read_available()


_open: dict[str, Channel] = {}  # path -> this controller's channel (roles sharing a process share it)
_open_lock = threading.Lock()


def connect(path: str | None) -> Channel | None:
    """This process's channel to the server at `path`, None where there is none to reach (another machine)."""
    if not path:
        return None
    with _open_lock:
        channel = _open.get(path)
        if channel is not None and not channel.closed:
            return channel
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        _open[path] = channel = Channel(sock, path)
        return channel


def disconnect(path: str | None) -> None:
    with _open_lock:
        channel = _open.pop(path, None) if path else None
    if channel is not None:
        channel.close()
