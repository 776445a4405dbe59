"""The Jupyter kernelspec for this environment: the interpreter that has rlbench_nb, the extension
loaded at start, and optionally the Ray address every session in the kernel should attach to.

    rlbench-nb kernel install [--ray-address HOST:PORT] [--name rlbench-nb] [--user | --prefix DIR]

The template lives in `kernels/rlbench-nb/kernel.json` (repository root); this writes a filled copy.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def kernel_json(display_name: str, ray_address: str | None) -> dict:
    env = {"RLBENCH_NB_KERNEL": "1"}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address  # ray.init() with no address joins this cluster
    return {
        # kernel_launcher.py: forked from the warm kernel server of `rlbench-nb up` when one runs, else plain ipykernel
        "argv": [sys.executable, "-m", "rlbench_nb.kernel_launcher", "-f", "{connection_file}",
                 "--IPKernelApp.extensions=rlbench_nb"],
        "display_name": display_name,
        "language": "python",
        "env": env,
        "metadata": {"debugger": True},
    }


def install(name: str = "rlbench-nb", display_name: str = "Python (rlbench-nb)", ray_address: str | None = None,
            user: bool = True, prefix: str | None = None) -> str:
    """Install the kernelspec; returns the directory Jupyter now lists."""
    from jupyter_client.kernelspec import KernelSpecManager
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / name
        d.mkdir()
        (d / "kernel.json").write_text(json.dumps(kernel_json(display_name, ray_address), indent=1))
        return KernelSpecManager().install_kernel_spec(str(d), kernel_name=name, user=user and not prefix,
                                                       prefix=prefix)
