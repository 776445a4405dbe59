"""Warm kernels: a process with a notebook's imports done, forking a Jupyter kernel from itself per request.

    python -m rlbench_nb.kernel_server      # started by `rlbench-nb up` (cluster/warm.py), stopped by `down`

A new kernel's first `rl.Session(cfg)` on the warm cluster spends most of its time importing torch, transformers,
Ray and the session (~5 s of a 2-core machine, ipykernel's own import on top); the warm role processes already
skip the rest. This server pays those imports once and, for each launcher (kernel_launcher.py), forks a child that
becomes that launcher's kernel: the launcher's stdin/stdout/stderr, working directory, environment and argv, a
session and process group of its own, fresh random seeds and multiprocessing key. Nothing here runs a torch op or
starts a thread of its own before forking (numpy's OpenBLAS pool has fork handlers). It stops when the warm cluster
does (its record gone, or its head); one server per $RLBENCH_NB_HOME (a lock file). Forked kernels keep the
server's command line (`ps` shows them as `python -m rlbench_nb.kernel_server`) and its str-hash secret.

A request is refused (the launcher then starts a plain kernel, saying why) when it comes from another Python
environment or as another user, when a setting read at start or import time (HF_*, TORCH*, OMP_*, RAY_*, PYTHONPATH,
the locale, HOME, ...) differs from this server's, or when rlbench_nb's source or the installed packages changed since
the imports (`pip install`): the server then exits, and the next `rlbench-nb up` starts a fresh one.
"""
from __future__ import annotations

import atexit
import fcntl
import json
import multiprocessing
import os
import random
import signal
import site
import socket
import sys
import threading
import time
from pathlib import Path

from .kernel_launcher import MESSAGE_BYTES, peer_uid, socket_path

PRELOAD = ("rlbench_nb.cluster", "ray", "torch", "numpy", "transformers", "ipykernel.kernelapp", "ipykernel.ipkernel",
           "rlbench_nb.session", "rlbench_nb.cluster.ray_backend", "rlbench_nb.cluster.ray_connect",
           "rlbench_nb.cluster.warm", "rlbench_nb.ipython")
PRELOAD_ATTRS = ("AutoTokenizer", "AutoConfig", "PreTrainedTokenizerFast")  # transformers' lazy names a task loads
# settings the interpreter's start or a preloaded module has already read: a kernel asking with other values gets
# a plain kernel (huggingface_hub fixes its cache from HOME / XDG_CACHE_HOME at import, the locale open()'s encoding)
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "GOMP_", "MKL_", "KMP_",
               "OPENBLAS_", "RAY_", "GRPC_", "LC_")
IMPORT_TIME_NAMES = {"PYTHONPATH", "PYTHONHASHSEED", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONUTF8",
                     "PYTHONWARNINGS", "LANG", "HOME", "XDG_CACHE_HOME", "LD_PRELOAD", "LD_LIBRARY_PATH"}
READ_LATER = {"RAY_ADDRESS"}  # read by ray.init, in the kernel (the kernelspec's --ray-address sets it)
CHECK_EVERY_S = 2.0
SERVER_CWD = os.getcwd()  # `python -m` put it on sys.path


def source_stamp() -> list:
    """(file, mtime, size) of every module of rlbench_nb, and the site-packages folders' mtimes (an install or
    uninstall changes them): a forked kernel must run the code on disk."""
    root = Path(__file__).parent
    ours = [(str(p.relative_to(root)), p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*.py")]
    return sorted(ours) + [(d, os.stat(d).st_mtime_ns) for d in site.getsitepackages() if os.path.isdir(d)]


def read_at_import(key: str) -> bool:
    return (key.startswith(IMPORT_TIME) or key in IMPORT_TIME_NAMES) and key not in READ_LATER


class Preloaded:
    """What the imports left: the environment they read, what they added to it, rlbench_nb's source stamp."""

    def __init__(self):
        before, self.stamp = dict(os.environ), source_stamp()
        import importlib
        for name in PRELOAD:
            importlib.import_module(name)
        import transformers
        for attr in PRELOAD_ATTRS:
            getattr(transformers, attr)
        self.env = dict(os.environ)
        self.added = {k: v for k, v in self.env.items() if k not in before}  # e.g. RAY_AUTH_MODE=token

    def refusal(self, request: dict) -> str | None:
        """Why this request cannot have a forked kernel, or None."""
        if os.path.realpath(request.get("prefix", "")) != os.path.realpath(sys.prefix):
            return f"the kernel server runs {sys.prefix}, not {request.get('prefix')}"
        asked = {**self.added, **request["env"]}
        for key in sorted(set(asked) | set(self.env)):
            if read_at_import(key) and asked.get(key) != self.env.get(key):
                return (f"{key} differs from the kernel server's ({self.env.get(key)!r}), which its imports already "
                        "read; start `rlbench-nb up` with the same environment as Jupyter")
        if source_stamp() != self.stamp:
            return ("rlbench_nb's source or the installed packages changed since the kernel server started; "
                    "`rlbench-nb up` starts a fresh one")
        return None


def become_kernel(conn: socket.socket, fds: list[int], request: dict, pre: Preloaded) -> None:
    """In the forked child: take the launcher's place and run ipykernel; never returns to the server's loop."""
    code = 1
    try:
        os.setsid()  # a group of its own, the kernel's subprocesses in it: the launcher signals the whole group
        # a process the kernel forks (multiprocessing, DataLoader workers) must not hold the launcher's connection:
        # the launcher would then miss this kernel's end
        os.register_at_fork(after_in_child=conn.close)
        multiprocessing.current_process().authkey = os.urandom(32)  # not the server's, shared by every kernel
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        env = {**pre.added, **request["env"]}
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        if SERVER_CWD in sys.path:  # `python -m` put it first (ray's import put its own folder before it since):
            sys.path.remove(SERVER_CWD)  # ipykernel_launcher drops its folder likewise, and its shell adds ''
        # ipykernel read JPY_PARENT_PID when this server imported it (0: a start banner for terminals); 1 says "no
        # parent to poll": the launcher watch below ends this kernel with its launcher, which ends with Jupyter
        sys.argv = ["ipykernel_launcher", *request["argv"], "--IPKernelApp.parent_handle=1"]
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        conn.sendall(json.dumps({"pid": os.getpid()}).encode())
        threading.Thread(target=_end_with_launcher, args=(conn,), daemon=True, name="launcher-watch").start()
        from ipykernel.kernelapp import launch_new_instance
        launch_new_instance()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        _exit(conn, code)


def _exit(conn: socket.socket, code: int) -> None:
    """What leaving the interpreter does (ipykernel's atexit close sends the shutdown reply; IPython's history, the
    user's handlers), then the exit code to the launcher, then out without the server's own frames' cleanup."""
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        try:
            conn.sendall(json.dumps({"exit": code}).encode())
        except OSError:
            pass
        os._exit(code)


def _end_with_launcher(conn: socket.socket) -> None:
    """The launcher never writes after its request: an end of file means it died (SIGKILL), and so does this kernel
    with every process it started (its group), as Jupyter's kill of a plain kernel's group would."""
    if not conn.recv(16):
        os.killpg(0, signal.SIGKILL)


def _cluster_alive(home: Path) -> bool:
    try:
        os.kill(json.loads((home / "cluster.json").read_text())["head_pid"], 0)
        return True
    except (OSError, ValueError, KeyError):
        return False


def serve() -> None:
    path = socket_path()
    lock = open(path.parent / "kernels.lock", "w")  # noqa: SIM115  (held for the server's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"a kernel server already runs for {path.parent}", flush=True)
        return
    pre = Preloaded()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    path.unlink(missing_ok=True)
    listener.bind(str(path))
    os.chmod(path, 0o600)  # a kernel runs code as whoever asks: only this user may
    listener.listen(16)
    listener.settimeout(CHECK_EVERY_S)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # exited kernels are reaped by the system
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    (path.parent / "kernels.json").write_text(json.dumps({"pid": os.getpid(), "socket": str(path)}))
    print(f"warm kernels ready at {path} (pid {os.getpid()})", flush=True)
    try:
        while _cluster_alive(path.parent):
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            if not _serve_one(conn, listener, lock, pre):
                break
    finally:
        if server_pid(path.parent) == os.getpid():  # not a newer server's files
            path.unlink(missing_ok=True)
            (path.parent / "kernels.json").unlink(missing_ok=True)


def server_pid(home: Path) -> int | None:
    """The pid of the kernel server whose record is under `home`, when it is alive (and not a reused pid)."""
    try:
        pid = int(json.loads((home / "kernels.json").read_text())["pid"])
        return pid if b"rlbench_nb.kernel_server" in Path(f"/proc/{pid}/cmdline").read_bytes() else None
    except (OSError, ValueError, KeyError):
        return None


def _serve_one(conn: socket.socket, listener: socket.socket, lock, pre: Preloaded) -> bool:
    """Fork a kernel for one launcher, or refuse it; False when this server should stop (its imports are stale).
    Whatever one request does wrong (malformed, a launcher gone, a fork the system refuses) costs only it."""
    fds: list[int] = []
    with conn:
        try:
            conn.settimeout(10)
            message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
            if peer_uid(conn) != os.getuid():
                return True  # a kernel runs code as whoever asks: only this user may (the socket is 0600 too)
            request = json.loads(message)
            why = pre.refusal(request) if len(fds) == 3 else "stdin, stdout and stderr were not passed"
            if why is None and os.fork() == 0:
                listener.close()
                lock.close()  # the lock is the server's alone: a new server may start while kernels live
                conn.settimeout(None)
                become_kernel(conn, fds, request, pre)
            if why is not None:
                print(f"{time.strftime('%H:%M:%S')} refused: {why}", flush=True)
                conn.sendall(json.dumps({"refused": why}).encode())
            return why is None or "changed since" not in why
        except Exception as e:  # noqa: BLE001  (the server stays for the next launcher)
            print(f"{time.strftime('%H:%M:%S')} a request failed: {type(e).__name__}: {e}", flush=True)
            return True
        finally:
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    serve()
