"""The kernelspec's command: a Jupyter kernel forked from the warm kernel server when one is up, else a plain one.

    python -m rlbench_nb.kernel_launcher -f {connection_file} [ipykernel options]

`rlbench-nb up` starts a kernel server (kernel_server.py) that has already imported what a notebook on rlbench-nb
imports (torch, transformers, Ray, the session, ipykernel): ~5-7 s of a 2-core machine that a new kernel then does
not pay. This launcher asks it for a kernel over a Unix socket and stands in for that kernel towards Jupyter: the
signals Jupyter sends (interrupt, terminate) go on to the kernel, its exit is this process's exit, and when this
process dies (SIGKILL) the kernel ends too. With no server, or one that refuses (another Python environment,
import-time settings that differ, rlbench_nb's source changed since it started), it becomes a plain ipykernel.

Only the standard library here: a launcher that imported torch would pay what it is there to skip.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MESSAGE_BYTES = 1 << 20  # one request: argv, cwd and the environment (SOCK_SEQPACKET keeps it one message)


def home() -> Path:
    """The warm cluster's folder (its record, logs, the kernel server's socket): $RLBENCH_NB_HOME, else ~/.rlbench-nb.
    Here, not in cluster/warm.py, because this launcher must not import what the cluster package imports."""
    return Path(os.environ.get("RLBENCH_NB_HOME") or Path.home() / ".rlbench-nb")


def socket_path() -> Path:
    """Where the warm kernel server listens."""
    return home() / "kernels.sock"


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def request(argv: list[str]) -> dict:
    return {"prefix": sys.prefix, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}


def ask(argv: list[str]) -> tuple[socket.socket, int] | str:
    """A forked kernel's (connection, pid), or why there is none."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(30)  # a server stopped or busy past this: a plain kernel instead
    try:
        conn.connect(str(socket_path()))
        if peer_uid(conn) != os.getuid():  # our environment and stdio go to no one else's process
            conn.close()
            return f"the socket {socket_path()} belongs to another user"
        socket.send_fds(conn, [json.dumps(request(argv)).encode()], [0, 1, 2])  # the kernel writes where we do
        reply = json.loads(conn.recv(MESSAGE_BYTES) or b'{"refused": "the kernel server closed the connection"}')
    except OSError as e:
        conn.close()
        return f"no warm kernel server ({e.strerror or e})"
    if "pid" not in reply:
        conn.close()
        return reply.get("refused", "the kernel server refused")
    return conn, int(reply["pid"])


def stand_in(conn: socket.socket, pid: int) -> int:
    """Forward Jupyter's signals to the kernel's process group (as Jupyter signals a plain kernel's) until it says
    it exited (or its end closes): its exit code."""
    def forward(signum, _frame):
        try:
            os.killpg(pid, signum)  # the kernel leads its own group (kernel_server.become_kernel)
        except ProcessLookupError:
            pass
    for signum in FORWARDED:
        signal.signal(signum, forward)
    # as ipykernel's own parent poll: a kernel ends with the process that started it (Jupyter), unless that was init
    parent = os.getppid()
    conn.settimeout(1.0)
    while True:
        try:
            message = conn.recv(MESSAGE_BYTES)  # a forwarded signal does not end the wait (PEP 475 retries)
        except TimeoutError:
            if parent != 1 and os.getppid() != parent:
                return 1  # our end closes: the kernel's watch ends it
            continue
        return int(json.loads(message)["exit"]) if message else 1  # closed without a word: it was killed


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    forked = ask(argv) if os.environ.get("RLBENCH_NB_WARM_KERNELS", "1") != "0" else "RLBENCH_NB_WARM_KERNELS=0"
    if isinstance(forked, tuple):
        sys.exit(stand_in(*forked))
    if socket_path().exists() or not forked.startswith("no warm kernel server"):
        print(f"rlbench-nb: a plain kernel ({forked})", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *argv])


if __name__ == "__main__":
    main()
