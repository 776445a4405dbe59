"""The file rules of checkpoints, on the ground floor (the workers import them; checkpoint.py, which
saves and loads a whole session, builds on them): atomic writes, the manifest and its verification,
tensors-only loads, checkpoint names, and finding the newest checkpoint that verifies.

Saves are atomic (a temporary sibling folder renamed into place: the previous checkpoint stays loadable
whatever happens mid-save; a failed save removes its temporary folder and says why — no space: how much
is free). Loads verify the manifest first and name the file that does not match; from a run directory
they fall back to the newest checkpoint that verifies, saying so. Nothing in a checkpoint is unpickled as
code: safetensors and JSON, and tensors-only files loaded with `weights_only=True`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import RLBenchError, disk_full, free_bytes

log = logging.getLogger(__name__)

RESERVED_NAMES = {"latest"}


class CheckpointError(RLBenchError, ValueError):
    """A checkpoint that cannot be written or loaded, and why."""


def checkpoint_path(run_dir: Path, name: str) -> Path:
    """`RUN_DIR/checkpoints/<name>`, for a name that is a plain folder name (no separators, not empty, '.',
    '..', hidden or reserved): anything else could write outside the folder or clobber its bookkeeping."""
    name = str(name)
    if (not name or name in (".", "..") or name.startswith(".") or "/" in name or "\\" in name
            or name in RESERVED_NAMES or os.sep in name):
        raise CheckpointError(f"checkpoint name {name!r} is not allowed: use a plain folder name such as "
                              "'step_100' (no path separators, not empty, not starting with '.', not 'latest')")
    return Path(run_dir) / "checkpoints" / name


def write_atomically(final: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling folder, then rename: a crash mid-save never leaves a half
    checkpoint under the final name, and the previous one stays loadable. Updates checkpoints/latest."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        (tmp / "MANIFEST.json").write_text(json.dumps(_manifest(tmp), indent=1))
        (tmp / "COMPLETE").write_text("ok")
    except BaseException as e:
        full = isinstance(e, Exception) and disk_full(e, final.parent)  # before the space comes back
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if full and tmp.exists() else 0
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save must not keep the disk full
        if full:
            raise CheckpointError(
                f"no space left to save checkpoint {final.name}: {written / 2**20:.1f} MiB were written before "
                f"the disk filled ({free_bytes(final.parent) / 2**20:.1f} MiB free now, and a checkpoint of "
                f"this run needs at least that much more). The partial save was removed; the previous checkpoint "
                f"({_latest_name(final.parent)}) is untouched. Free space, then save again") from e
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    latest_tmp = final.parent / f".latest.tmp{os.getpid()}"
    latest_tmp.write_text(final.name)
    latest_tmp.replace(final.parent / "latest")


def _latest_name(folder: Path) -> str:
    try:
        return (folder / "latest").read_text().strip()
    except OSError:
        return "none yet"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _manifest(folder: Path) -> dict:
    """{relative path: {"bytes", "sha256"}} of every file in a checkpoint folder."""
    return {str(f.relative_to(folder)): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(folder.rglob("*")) if f.is_file() and f.name not in ("MANIFEST.json", "COMPLETE")}


def verify(path: Path) -> None:
    """Check every file against MANIFEST.json (sizes first: cheap; then sha256): a CheckpointError names
    the first file that is missing, truncated or changed."""
    try:
        manifest = json.loads((path / "MANIFEST.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has no readable MANIFEST.json ({e}): it is incomplete or was "
                              "written by an older rlbench-nb; load another one") from None
    for name, want in manifest.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} has {f.stat().st_size} bytes, "
                                  f"{want['bytes']} were saved (truncated?)")
    for name, want in manifest.items():
        if _sha256(path / name) != want["sha256"]:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} does not match its sha256 "
                                  "(changed or corrupted since it was saved)")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def load_tensors(path: Path, map_location=None):
    """torch.load with weights_only=True: tensors and plain containers only. A file that would run code
    when unpickled (or is not a torch file at all) is refused with the file named, and nothing runs."""
    import torch
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"refusing to load {path}: it is not a tensors-only file ({first}). Checkpoints "
                              "are loaded without executing pickled code; load an earlier checkpoint") from None


def _complete(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if not p.name.startswith(".") and (p / "COMPLETE").exists()]


def saved_names(run_dir: Path) -> list[str]:
    """The names of the run's complete checkpoints, sorted."""
    folder = Path(run_dir) / "checkpoints"
    return sorted(p.name for p in _complete(folder)) if folder.is_dir() else []


def _saved_ns(checkpoint: Path) -> int:
    return (checkpoint / "COMPLETE").stat().st_mtime_ns  # written last inside the folder, just before the rename


def resolve(path: Path) -> Path:
    """A verified checkpoint folder from a checkpoint path, a checkpoints/ folder or a run directory.

    From a run directory (or checkpoints/): `latest`, updated right after a save's rename; a process
    killed in between leaves it naming the previous checkpoint, so the checkpoint saved last (by its
    COMPLETE marker, written just before the rename) wins. One that fails verification is passed over for
    the newest one that verifies, with a warning naming the bad file. A checkpoint named directly must
    verify itself: a CheckpointError says what is wrong and which other checkpoints there are."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        pointer = candidate / "latest"
        if pointer.is_file():
            return _newest_good(candidate, candidate / pointer.read_text().strip(), pointer.stat().st_mtime_ns)
    if not (path / "controller.json").exists():
        raise CheckpointError(f"no checkpoint at {path} (expected controller.json; give a checkpoint folder "
                              "or a run directory with checkpoints/latest)")
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"checkpoint {path} is incomplete (interrupted save?); load an earlier one")
    try:
        verify(path)
    except CheckpointError as e:
        others = sorted(p.name for p in _complete(path.parent) if p != path)
        raise CheckpointError(f"{e}. Other checkpoints of this run: {others or 'none'}") from None
    return path.absolute()


def _newest_good(folder: Path, named: Path, pointer_ns: int) -> Path:
    # the one `latest` names, unless a later save finished without moving `latest`; then the others, newest first
    complete = sorted(_complete(folder), key=_saved_ns, reverse=True)
    newer = [c for c in complete if _saved_ns(c) > pointer_ns]
    order = newer + [named] + [c for c in complete if c not in newer and c != named]
    problems = []
    for candidate in order:
        if not (candidate / "COMPLETE").exists():
            problems.append(f"{candidate.name}: missing or incomplete")
            continue
        try:
            verify(candidate)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if candidate != named or problems:
            log.warning("checkpoints/latest names %s; using %s instead (%s)", named.name, candidate.name,
                        "; ".join(problems) or f"{candidate.name} was saved after it, by a save interrupted "
                        "before it could update latest")
        return candidate.absolute()
    raise CheckpointError(f"no checkpoint in {folder} verifies: " + "; ".join(problems))
