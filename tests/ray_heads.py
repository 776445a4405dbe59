"""A `ray start --head` cluster that a test starts and stops alone, whatever else runs on the machine.

`ray stop` stops every Ray cluster on the machine (another test's, a user's). A head started with `--block`
stays in the foreground and owns what it started: SIGTERM to that one process stops its cluster and nothing
else (measured: ~4 s, where `ray stop --force` took 5-11). Its own `--temp-dir` names its processes.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
READY = "block forever"  # `ray start --block` prints this once every process of the head is up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayHead:
    """`with RayHead() as head:` a token-authenticated head on loopback (`head.address`), stopped on exit. With
    `dashboard_port`, its dashboard (the job API) listens on 127.0.0.1 at that port."""

    def __init__(self, num_cpus: int = 4, dashboard_port: int | None = None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"  # the GCS listens on every interface (Ray's choice), loopback too
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: unix socket paths have a limit
        self.log = self.temp_dir / "start.log"
        env = {**os.environ, "RAY_AUTH_MODE": "token"}  # the token in ~/.ray/auth_token, as documented
        subprocess.run([RAY_CLI, "get-auth-token", "--generate"], check=True, timeout=60, capture_output=True, env=env)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [RAY_CLI, "start", "--head", "--block", f"--port={self.port}", f"--num-cpus={num_cpus}",
                 f"--temp-dir={self.temp_dir}",
                 # ports Ray would otherwise take at a fixed number (10001, 52365): two heads at once must not clash
                 f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                 *(["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
                   if dashboard_port else ["--include-dashboard=false"]), "--disable-usage-stats"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + 180
        while READY not in self.log.read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"ray start --head did not come up:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def processes(self) -> list[str]:
        """This cluster's processes still alive (each names its temp dir on its command line)."""
        out = subprocess.run(["pgrep", "-af", str(self.temp_dir)], capture_output=True, text=True)
        return [line for line in out.stdout.splitlines() if "pgrep" not in line]

    def stop(self, timeout: float = 60) -> list[str]:
        """Stop this cluster alone: SIGTERM to the blocking `ray start`, which stops what it started; SIGKILL to
        what is left after `timeout`. Returns what had to be killed (a test asserts it is nothing)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.time() + timeout
        while self.processes() and time.time() < deadline:
            time.sleep(0.2)
        left = self.processes()
        for line in left:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left

    def __enter__(self) -> RayHead:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
