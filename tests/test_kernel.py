"""The kernelspec and the IPython extension, with a real Jupyter kernel."""
import json
import os
import subprocess
import sys

from rlbench_nb.cluster.errors import WorkerError
from rlbench_nb.ipython import format_worker_error

from .conftest import REPO


def test_kernel_install_is_listed_and_starts_with_the_extension(tmp_path, monkeypatch):
    out = subprocess.run([sys.executable, "-m", "rlbench_nb.cli", "kernel", "install", "--prefix", str(tmp_path),
                          "--ray-address", "127.0.0.1:6379"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    env = {**os.environ, "JUPYTER_PATH": str(tmp_path / "share" / "jupyter")}
    listed = subprocess.run([sys.executable, "-m", "jupyter", "kernelspec", "list", "--json"], capture_output=True,
                            text=True, env=env, timeout=120)
    specs = json.loads(listed.stdout)["kernelspecs"]
    spec = specs["rlbench-nb"]["spec"]
    assert spec["display_name"] == "Python (rlbench-nb)" and spec["argv"][0] == sys.executable
    assert spec["argv"][1:3] == ["-m", "rlbench_nb.kernel_launcher"]  # warm when `rlbench-nb up` runs, else plain
    assert spec["env"]["RAY_ADDRESS"] == "127.0.0.1:6379"

    from jupyter_client.manager import start_new_kernel
    monkeypatch.setenv("JUPYTER_PATH", env["JUPYTER_PATH"])
    km, kc = start_new_kernel(kernel_name="rlbench-nb")
    try:
        code = ("import os, rlbench_nb\n"
                "print('loaded', 'rlbench_nb' in get_ipython().extension_manager.loaded, os.environ['RAY_ADDRESS'])\n"
                "print(get_ipython().run_line_magic('rl', 'status'))")
        outputs = []
        kc.execute_interactive(code, timeout=120, output_hook=lambda m: outputs.append(m["content"].get("text", "")))
        text = "".join(outputs)
        assert "loaded True 127.0.0.1:6379" in text
        assert "no live rlbench-nb sessions" in text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_worker_error_display_puts_the_user_line_first():
    err = WorkerError("policy", 1, "update", "KeyError: 'x'", "/home/me/reward.py:12: return d['x']",
                      "Traceback (most recent call last):\n  ...\nKeyError: 'x'\n")
    text = format_worker_error(err)
    first, second, third = text.splitlines()[:3]
    assert first == "WorkerError: policy rank 1 failed in update()"
    assert second == "  KeyError: 'x'" and third == "  at /home/me/reward.py:12: return d['x']"
    assert "worker traceback:" in text
