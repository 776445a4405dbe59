"""Checkpoints: a whole session's state in a folder, saved and loaded by two free functions (as nanochat's
`save_checkpoint` / `load_checkpoint`), and the file rules that keep them safe.

    RUN_DIR/checkpoints/<name>/
      config.yaml         the run's config
      controller.json     step, data position, KL controller, evals (the controller's own state)
      policy/             model.safetensors (a from_pretrained-loadable directory) + trainer_state.pt
      critic/             value_model.safetensors + trainer_state.pt (PPO)
      rollout_state.pt    each rollout rank's sampling RNG
      COMPLETE            written last: a folder without it is an interrupted save
    RUN_DIR/checkpoints/latest   the name of the newest checkpoint

Saves are atomic (a temporary sibling folder renamed into place: the previous checkpoint stays loadable
whatever happens mid-save). Nothing in a checkpoint is unpickled as code: tensors-only files are loaded
with `weights_only=True`.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import RLBenchError

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger(__name__)

RESERVED_NAMES = {"latest"}


class CheckpointError(RLBenchError, ValueError):
    """A checkpoint that cannot be written or loaded, and why."""


# ---- the two functions the controller calls ------------------------------------------------------
def save(sess: Session, name: str) -> Path:
    """A checkpoint that resumes exactly: weights, optimizer, RNG, data position, step, KL controller."""
    import torch
    final = checkpoint_path(sess.run_dir, name)
    controller = sess.controller_state()
    groups = sess.workers.groups

    def write(tmp: Path) -> None:
        sess.cfg.save(tmp / "config.yaml")
        (tmp / "controller.json").write_text(json.dumps(controller, indent=1))
        groups["policy"].call("save", str(tmp / "policy"))  # all ranks: gathers when sharded
        if "critic" in groups:
            groups["critic"].call("save", str(tmp / "critic"))
        torch.save(groups["rollout"].call("get_state"), tmp / "rollout_state.pt")

    write_atomically(final, write)
    return final


def restore(sess: Session, path: Path) -> None:
    """Bring `sess` to the checkpoint at `path` (a folder from `resolve`): trainer weights and optimizers,
    the rollout engine's weights and RNG, the controller's state, the metrics history."""
    groups = sess.workers.groups
    states = load_tensors(path / "rollout_state.pt")  # one per rollout rank
    if len(states) != groups["rollout"].world_size:
        raise CheckpointError(f"checkpoint {path} has {len(states)} rollout rank(s); this session has "
                              f"{groups['rollout'].world_size}: set cluster.rollout_ranks to match")
    controller = json.loads((path / "controller.json").read_text())
    groups["policy"].call("load", str(path / "policy"))
    if "critic" in groups:
        groups["critic"].call("load", str(path / "critic"))
    groups["rollout"].call_each("set_state", [(s,) for s in states])
    sess.load_controller_state(controller)
    sess.workers.sync(version=sess.step_count)


def load(path: str | Path, run_dir: str | Path | None = None, overrides=()) -> Session:
    """A new session from a checkpoint folder or a run directory (its latest checkpoint). It writes into
    `run_dir` when given, else into the run directory the checkpoint belongs to."""
    from .config import Config
    from .session import Session
    path = resolve(Path(path))
    cfg = Config.load(path / "config.yaml", overrides)
    sess = Session(cfg, run_dir=Path(run_dir) if run_dir else path.parent.parent)
    try:
        restore(sess, path)
    except BaseException:
        sess.close()
        raise
    return sess


# ---- files --------------------------------------------------------------------------------------
def checkpoint_path(run_dir: Path, name: str) -> Path:
    """RUN_DIR/checkpoints/<name>, for a name that is a plain folder name (no separators, not empty, '.',
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
    tmp.mkdir()
    write(tmp)
    (tmp / "COMPLETE").write_text("ok")
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


def load_tensors(path: Path, map_location=None):
    """torch.load with weights_only=True: tensors and plain containers only. A file that would run code
    when unpickled (or is not a torch file at all) is refused with the file named, and nothing runs."""
    import torch
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"refusing to load {path}: it is not a tensors-only file ({first}). Checkpoints "
                              "are loaded without executing pickled code; load an earlier checkpoint") from None


def _complete(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if not p.name.startswith(".") and (p / "COMPLETE").exists()]


def _saved_ns(checkpoint: Path) -> int:
    return (checkpoint / "COMPLETE").stat().st_mtime_ns  # written last inside the folder, just before the rename


def resolve(path: Path) -> Path:
    """A checkpoint folder from a checkpoint path, a checkpoints/ folder or a run directory (-> latest).

    `latest` is updated right after a save's rename; a process killed in between leaves it naming the
    previous checkpoint (or, if a checkpoint of the same name was being replaced, nothing). Either way the
    checkpoint saved last (by its COMPLETE marker, written just before the rename) is used, with a warning."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        pointer = candidate / "latest"
        if pointer.is_file():
            path = candidate / pointer.read_text().strip()
            newer = [c for c in _complete(candidate) if _saved_ns(c) > pointer.stat().st_mtime_ns]
            if newer or not path.exists():
                last = max(newer or _complete(candidate), key=_saved_ns, default=None)
                if last is not None and last != path:
                    log.warning("checkpoints/latest names %s, but %s was saved after it (a save interrupted "
                                "before it could update latest): using %s", path.name, last.name, last.name)
                    path = last
            break
    if not (path / "controller.json").exists():
        raise CheckpointError(f"no checkpoint at {path} (expected controller.json; give a checkpoint folder "
                              "or a run directory with checkpoints/latest)")
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"checkpoint {path} is incomplete (interrupted save?); load an earlier one")
    return path.absolute()
