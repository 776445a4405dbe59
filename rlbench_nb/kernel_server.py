"""Warm kernels: a process with a notebook's imports done, forking a Jupyter kernel from itself per request.

    python -m rlbench_nb.kernel_server      # started by `rlbench-nb up` (cluster/warm.py), stopped by `down`

A new kernel's first `rl.Session(cfg)` on the warm cluster spends most of its time importing torch, transformers,
Ray and the session (~5 s of a 2-core machine, ipykernel's own import on top); the warm role processes already
skip the rest. This server pays those imports once and, for each launcher (kernel_launcher.py), forks a child that
becomes that launcher's kernel: the launcher's stdin/stdout/stderr, working directory, environment and argv, a
session and process group of its own, fresh random seeds. Nothing here runs a torch op or starts a thread before
forking (a child cannot inherit a thread pool). It stops when the warm cluster does (its record gone, or its head).

A request is refused (the launcher then starts a plain kernel, saying why) when it comes from another Python
environment, when a setting read at import time (HF_*, TORCH*, OMP_*, RAY_*, PYTHONPATH, ...) differs from this
server's, or when rlbench_nb's source changed since the imports: the server then exits, and the next
`rlbench-nb up` starts a fresh one.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .kernel_launcher import MESSAGE_BYTES, socket_path

PRELOAD = ("rlbench_nb.cluster", "ray", "torch", "numpy", "transformers", "ipykernel.kernelapp", "ipykernel.ipkernel",
           "rlbench_nb.session", "rlbench_nb.cluster.ray_backend", "rlbench_nb.cluster.ray_connect",
           "rlbench_nb.cluster.warm", "rlbench_nb.ipython")
PRELOAD_ATTRS = ("AutoTokenizer", "AutoConfig", "PreTrainedTokenizerFast")  # transformers' lazy names a task loads
# settings a preloaded module has already read: a kernel asking with other values gets a plain kernel
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_", "OPENBLAS_",
               "RAY_", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONHOME", "LD_PRELOAD", "LD_LIBRARY_PATH")
READ_LATER = {"RAY_ADDRESS"}  # read by ray.init, in the kernel (the kernelspec's --ray-address sets it)
CHECK_EVERY_S = 2.0
SERVER_CWD = os.getcwd()  # `python -m` put it first on sys.path


def source_stamp() -> list:
    """(file, mtime, size) of every module of rlbench_nb: a forked kernel must run the source on disk."""
    root = Path(__file__).parent
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*.py"))


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
            if key.startswith(IMPORT_TIME) and key not in READ_LATER and asked.get(key) != self.env.get(key):
                return (f"{key} differs from the kernel server's ({self.env.get(key)!r}), which its imports already "
                        "read; start `rlbench-nb up` with the same environment as Jupyter")
        if source_stamp() != self.stamp:
            return "rlbench_nb's source changed since the kernel server started; `rlbench-nb up` starts a fresh one"
        return None


def become_kernel(conn: socket.socket, fds: list[int], request: dict, pre: Preloaded) -> None:
    """In the forked child: take the launcher's place and run ipykernel; never returns to the server's loop."""
    code = 1
    try:
        os.setsid()  # Jupyter's signals reach the launcher's group; the launcher forwards them here
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
        if sys.path and sys.path[0] == SERVER_CWD:  # as ipykernel_launcher does: its shell puts '' back
            del sys.path[0]
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
        try:
            conn.sendall(json.dumps({"exit": code}).encode())
        except OSError:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _end_with_launcher(conn: socket.socket) -> None:
    """The launcher never writes after its request: an end of file means it died (SIGKILL), and so does this."""
    if not conn.recv(16):
        os._exit(1)


def _cluster_alive(home: Path) -> bool:
    try:
        os.kill(json.loads((home / "cluster.json").read_text())["head_pid"], 0)
        return True
    except (OSError, ValueError, KeyError):
        return False


def serve() -> None:
    path = socket_path()
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
            if not _serve_one(conn, listener, pre):
                break
    finally:
        if server_pid(path.parent) == os.getpid():  # not a newer server's files
            path.unlink(missing_ok=True)
            (path.parent / "kernels.json").unlink(missing_ok=True)


def server_pid(home: Path) -> int | None:
    """The pid of the kernel server whose record is under `home`, when it is alive."""
    try:
        pid = int(json.loads((home / "kernels.json").read_text())["pid"])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, KeyError):
        return None


def _serve_one(conn: socket.socket, listener: socket.socket, pre: Preloaded) -> bool:
    """Fork a kernel for one launcher, or refuse it; False when this server should stop (its imports are stale)."""
    with conn:
        conn.settimeout(10)
        try:
            message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
            request = json.loads(message)
        except (OSError, ValueError) as e:
            print(f"a malformed request ({e}): ignored", flush=True)
            return True
        why = pre.refusal(request) if len(fds) == 3 else "stdin, stdout and stderr were not passed"
        if why is None and os.fork() == 0:
            listener.close()
            conn.settimeout(None)
            become_kernel(conn, fds, request, pre)
        for fd in fds:
            os.close(fd)
        if why is not None:
            conn.sendall(json.dumps({"refused": why}).encode())
            print(f"{time.strftime('%H:%M:%S')} refused: {why}", flush=True)
        return why is None or "source changed" not in why


if __name__ == "__main__":
    serve()
