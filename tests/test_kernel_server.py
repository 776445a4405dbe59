"""Warm kernels (kernel_server.py + kernel_launcher.py) with real Jupyter kernels: a kernel of the rlbench-nb
kernelspec is forked from the server, Jupyter's interrupt reaches it through its launcher, a killed launcher takes
it along, a refused request gets a plain kernel saying why, and the server ends with its cluster. The server here
preloads nothing (the real preload, torch and all, runs in tests/cluster/test_warm.py's warm cluster)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlbench_nb import kernel_server
from rlbench_nb.kernelspec import install

from .conftest import alive, wait_until

JUPYTER_DIES = """
import os, sys
from jupyter_client.manager import start_new_kernel
km, kc = start_new_kernel(kernel_name="rlbench-nb", cwd=sys.argv[1])
kc.execute_interactive("import os; print(os.getpid())", output_hook=lambda m: print(m["content"].get("text", "")))
sys.stdout.flush()
os._exit(0)
"""
WHERE = ("import json, os, sys; "
         "print(json.dumps([os.getpid(), os.getppid(), os.getcwd(), os.environ['MINE'], sys.path[0]]))")
SERVER = "import rlbench_nb.kernel_server as k; k.PRELOAD = k.PRELOAD_ATTRS = (); k.serve()"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A warm cluster's record whose head is this test's process (alive), the kernelspec, and Jupyter finding it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "cluster.json").write_text(json.dumps({"address": "127.0.0.1:1", "head_pid": os.getpid()}))
    monkeypatch.setenv("RLBENCH_NB_HOME", str(home))
    install(prefix=str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))
    return home


def _server(home):
    log = (home / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=home, stdout=log, stderr=subprocess.STDOUT)
    assert wait_until(lambda: kernel_server.server_pid(home) == proc.pid, 60), (home / "server.log").read_text()
    return proc


def _run(kc, code: str) -> str:
    out = []
    reply = kc.execute_interactive(code, timeout=60, output_hook=lambda m: out.append(m["content"].get("text", "")))
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out).strip()


@pytest.mark.integration  # Jupyter kernels: the second stage (pyproject.toml's markers)
def test_a_kernel_forks_from_the_server_takes_interrupts_and_ends_with_its_launcher(home, tmp_path):
    from jupyter_client.manager import start_new_kernel
    server = _server(home)
    try:
        km, kc = start_new_kernel(kernel_name="rlbench-nb", cwd=str(tmp_path), env={**os.environ, "MINE": "7"})
        try:
            pid, parent, cwd, mine, path0 = json.loads(_run(kc, WHERE))
            assert parent == server.pid and pid != km.provisioner.pid  # the server's child; the launcher stands in
            assert cwd == str(tmp_path) and mine == "7" and path0 == ""  # the launcher's folder and environment
            kc.execute("import time; time.sleep(120)", stop_on_error=False)  # the next cell is not aborted after it
            time.sleep(1.0)
            km.interrupt_kernel()  # Jupyter signals the launcher's process group; the launcher forwards it
            interrupted = kc.get_shell_msg(timeout=30)["content"]
            assert interrupted["status"] == "error" and interrupted["ename"] == "KeyboardInterrupt", interrupted
            assert _run(kc, "print(6 * 7)") == "42"  # still the same kernel, working
            child = int(_run(kc, "import subprocess; p = subprocess.Popen(['sleep', '300']); print(p.pid)"))
            os.kill(km.provisioner.pid, signal.SIGKILL)
            assert wait_until(lambda: not alive(pid), 15), "a kernel outlived its killed launcher"
            assert wait_until(lambda: not alive(child), 15), "a process the kernel started outlived it"
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        km, kc = start_new_kernel(kernel_name="rlbench-nb", cwd=str(tmp_path))
        pid = int(_run(kc, "import atexit, os, pathlib; atexit.register(pathlib.Path('atexit-ran').touch); "
                           "print(os.getpid())"))
        kc.stop_channels()
        km.shutdown_kernel()  # Jupyter's own shutdown: the kernel exits as an interpreter does, its launcher with it
        assert wait_until(lambda: not alive(pid), 15) and (tmp_path / "atexit-ran").exists()
        second = subprocess.run([sys.executable, "-c", SERVER], cwd=home, capture_output=True, text=True, timeout=60)
        assert "a kernel server already runs" in second.stdout  # one per home: the lock
        # a Jupyter that dies without shutting its kernel down: the kernel ends too, as a plain one would
        jupyter = subprocess.run([sys.executable, "-c", JUPYTER_DIES, str(tmp_path)], capture_output=True, text=True,
                                 timeout=120)
        orphan = int(jupyter.stdout.split()[-1])
        assert wait_until(lambda: not alive(orphan), 15), "a kernel outlived the Jupyter that started it"
        (home / "cluster.json").unlink()  # the cluster is gone: so is its kernel server, and its files
        assert server.wait(timeout=30) == 0 and not (home / "kernels.sock").exists()
    finally:
        server.kill()


@pytest.mark.integration
def test_a_refused_kernel_is_a_plain_one_that_says_why(home, tmp_path):
    from jupyter_client.manager import start_new_kernel
    server = _server(home)
    try:
        err = tmp_path / "launcher.err"
        with err.open("w") as stderr:
            km, kc = start_new_kernel(kernel_name="rlbench-nb", cwd=str(tmp_path), stderr=stderr,
                                      env={**os.environ, "HF_HOME": str(tmp_path / "elsewhere")})
        try:
            pid = int(_run(kc, "import os; print(os.getpid())"))
            assert pid == km.provisioner.pid  # the launcher became a plain kernel itself
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        assert "a plain kernel (HF_HOME differs from the kernel server's" in err.read_text()
        assert server.poll() is None  # a mismatch costs one kernel its head start, not the server
    finally:
        server.kill()


class _Pre(kernel_server.Preloaded):
    def __init__(self, env: dict, added: dict):  # what the imports read, without doing them
        self.env, self.added, self.stamp = env, added, kernel_server.source_stamp()


def test_refusals_name_the_setting_and_what_to_do(monkeypatch):
    pre = _Pre({"HF_HOME": "/a", "RAY_AUTH_MODE": "token", "PATH": "/bin"}, added={"RAY_AUTH_MODE": "token"})
    ok = {"prefix": sys.prefix, "env": {"HF_HOME": "/a", "PATH": "/usr/bin", "RAY_ADDRESS": "h:1"}}
    assert pre.refusal(ok) is None  # PATH is not read at import; RAY_ADDRESS is read by ray.init; RAY_AUTH_MODE ours
    assert "runs " in pre.refusal({**ok, "prefix": "/other/venv"})
    assert pre.refusal({**ok, "env": {**ok["env"], "HF_HOME": "/b"}}).startswith("HF_HOME differs")
    assert pre.refusal({**ok, "env": {**ok["env"], "OMP_NUM_THREADS": "1"}}).startswith("OMP_NUM_THREADS differs")
    assert pre.refusal({**ok, "env": {k: v for k, v in ok["env"].items() if k != "HF_HOME"}}).startswith("HF_HOME")
    assert pre.refusal({**ok, "env": {**ok["env"], "HOME": "/elsewhere"}}).startswith("HOME differs")
    assert pre.refusal({**ok, "env": {**ok["env"], "LC_ALL": "C"}}).startswith("LC_ALL differs")
    monkeypatch.setattr(kernel_server, "source_stamp", lambda: [("session.py", 1, 2)])
    assert "source or the installed packages changed since" in pre.refusal(ok)


def test_the_stamp_sees_a_package_installed_or_removed(tmp_path, monkeypatch):
    site_packages = tmp_path / "site-packages"
    site_packages.mkdir()
    monkeypatch.setattr(kernel_server.site, "getsitepackages", lambda: [str(site_packages)])
    before = kernel_server.source_stamp()
    time.sleep(0.01)
    (site_packages / "newpkg-1.0.dist-info").mkdir()  # what `pip install` leaves
    assert kernel_server.source_stamp() != before
