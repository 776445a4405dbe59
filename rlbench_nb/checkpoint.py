"""Checkpoints: a whole session's state in a folder, saved and restored by two free functions (as nanochat's
`save_checkpoint` / `load_checkpoint`; `Session.load` builds a session and restores into it), over the file
rules of checkpoint_files.py that keep them safe.

    RUN_DIR/checkpoints/<name>/
      config.yaml         the run's config
      controller.json     step, data position, KL controller, evals (the controller's own state)
      policy/             weights: one rank, model.safetensors + config + tokenizer (a from_pretrained folder);
                          sharded, each rank's shard-0000k-*.safetensors (roles/shards.py); LoRA, the peft adapter
        optimizer/        the optimizer's tensors laid out as the weights are + param_groups.json
        trainer_state.pt  RNG state (tensors only)
      critic/             value_model.safetensors or each rank's shards, optimizer/ (PPO)
      rollout_state.pt    each rollout rank's sampling RNG
      MANIFEST.json       size and sha256 of every file above
      COMPLETE            written last: a folder without it is an interrupted save
    RUN_DIR/checkpoints/latest   the name of the newest checkpoint

Saves are atomic (a temporary sibling folder renamed into place: the previous checkpoint stays loadable
whatever happens mid-save; a failed save removes its temporary folder and says why — no space: how much
is free). Loads verify the manifest first and name the file that does not match; from a run directory
they fall back to the newest checkpoint that verifies, saying so. Weights and optimizer state load onto any
number of trainer ranks. Nothing in a checkpoint is unpickled as code: safetensors and JSON, and tensors-only
files loaded with `weights_only=True`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

# the file rules (checkpoint_files.py); CheckpointError and resolve are also what callers use as checkpoint.X
from .checkpoint_files import (
    CheckpointError,
    checkpoint_path,
    load_tensors,
    read_json,
    resolve,
    saved_names,
    write_atomically,
)
from .roles import CriticWorker, PolicyWorker
from .roles.rollout.base import RolloutWorker

if TYPE_CHECKING:
    from .session import Session

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
        groups["policy"].call(PolicyWorker.save, str(tmp / "policy"))  # all ranks: gathers when sharded
        if "critic" in groups:
            groups["critic"].call(CriticWorker.save, str(tmp / "critic"))
        torch.save(groups["rollout"].call(RolloutWorker.get_state), tmp / "rollout_state.pt")

    write_atomically(final, write)
    sess.progress.last_saved_step = controller["step"]
    return final


def restore(sess: Session, path: Path) -> None:
    """Bring `sess` to the checkpoint at `path` (a folder from `resolve`, so verified): trainer weights and
    optimizers, the rollout engine's weights and RNG, the controller's state, the metrics history.
    Everything that can be checked is checked before any worker is touched."""
    groups = sess.workers.groups
    states = load_tensors(path / "rollout_state.pt")  # one per rollout rank
    if len(states) != groups["rollout"].world_size:
        raise CheckpointError(f"checkpoint {path} has {len(states)} rollout rank(s); this session has "
                              f"{groups['rollout'].world_size}: set cluster.rollout_ranks to match")
    controller = read_json(path / "controller.json")
    check_config(path, sess.cfg)
    groups["policy"].call(PolicyWorker.load, str(path / "policy"))
    if "critic" in groups:
        groups["critic"].call(CriticWorker.load, str(path / "critic"))
    groups["rollout"].call_each(RolloutWorker.set_state, [(s,) for s in states])
    sess.return_to(controller)
    sess.progress.last_saved_step = sess.step_count


def locate(run_dir: Path, name: str | Path | None) -> Path:
    """What `sess.load(name)` means: None or "latest", the run directory (its latest checkpoint); a plain name of
    one of this run's checkpoints, that one (a folder of that name in the working directory does not shadow it);
    anything else, a folder. Neither: a CheckpointError listing this run's checkpoints."""
    if name is None or str(name) == "latest":
        return Path(run_dir)
    mine = Path(run_dir) / "checkpoints"
    if isinstance(name, str) and "/" not in name and (mine / name).is_dir():
        return mine / name
    if Path(name).exists():
        return Path(name)
    if len(Path(name).parts) == 1 and (mine / Path(name).name).is_dir():  # Path("step_1"), no such folder here
        return mine / Path(name).name
    have = saved_names(run_dir)
    raise CheckpointError(f"no checkpoint {str(name)!r}: this run ({run_dir}) has no checkpoint of that name and "
                          f"there is no such folder; this run's checkpoints: {have or 'none yet (sess.save())'}")


def check_config(path: Path, cfg) -> None:
    """The checkpoint at `path` fits a session made from `cfg`: its `model` and `task` sections, which decide
    the weights' shapes (LoRA or not, which model), are `cfg`'s. Else the error names each setting that
    differs, so `Session.load` refuses before it claims a run directory or starts a worker."""
    from .config import Config
    saved = Config.load(path / "config.yaml")
    diffs = [f"{section}.{key} is {old!r} there, {new!r} here" for section in ("model", "task")
             for key, old, new in _differences(getattr(saved, section).model_dump(),
                                               getattr(cfg, section).model_dump())]
    if diffs:
        raise CheckpointError(f"checkpoint {path} was saved with other weights' settings than this session's: "
                              f"{'; '.join(diffs)}. Set them as the checkpoint has them, or load it into a session "
                              f"made from its own config.yaml (rl.Session.load('{path}'))")


def _differences(saved: dict, current: dict, prefix: str = ""):
    """(dotted key, saved value, current value) for each leaf setting that differs."""
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            yield from _differences(old, new, f"{prefix}{key}.")
        elif old != new:
            yield f"{prefix}{key}", old, new


def export_weights(path: str | Path, out: str | Path) -> Path:
    """The policy of a checkpoint (or a run's latest) as a Hugging Face model folder in `out`: one whole
    model.safetensors joined from however many ranks' shards, its config and tokenizer. A LoRA checkpoint's
    adapter is merged into its base model (W + alpha/r * B @ A, as the rollout engine receives it); its
    policy/ stays a peft adapter folder too (PeftModel.from_pretrained)."""
    from safetensors.torch import save_file

    from .roles.shards import whole_tensors
    policy = resolve(Path(path)) / "policy"
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty: give a new folder")
    if (policy / "adapter_config.json").exists():
        weights, files_from = _merged_adapter(policy)
    else:  # read (and checked whole) before anything is written
        weights, files_from = whole_tensors(policy), policy
    out.mkdir(parents=True, exist_ok=True)
    for f in files_from.iterdir():  # config, generation config, tokenizer (not an index of the saved files)
        if f.is_file() and not f.name.endswith((".safetensors", ".pt", ".index.json")):
            shutil.copy2(f, out / f.name)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _merged_adapter(policy: Path) -> tuple[dict, Path]:
    """A LoRA checkpoint's policy as whole base-model weights with the adapter merged in, and the base folder
    (config, tokenizer): the base is the folder the adapter was trained on (adapter_config.json)."""
    from safetensors.torch import load_file

    from .roles import lora
    config = json.loads((policy / "adapter_config.json").read_text())
    named = config.get("base_model_name_or_path")
    base = Path(named or "-")
    files = sorted(base.glob("*.safetensors")) if named and base.is_dir() else []
    if not files:
        raise CheckpointError(f"{policy}: the adapter's base model {named!r} (base_model_name_or_path in "
                              "adapter_config.json) is no folder of safetensors on this machine: put the base "
                              "model there, or merge with PeftModel.from_pretrained(base, that folder)")
    base_state = {k: v for f in files for k, v in load_file(f).items()}
    adapter = lora.adapter_to_model_names(load_file(policy / "adapter_model.safetensors"))
    adapted = {k.split(".lora_A.")[0].removeprefix(lora.PREFIX) for k in adapter if ".lora_A." in k}
    missing = sorted(stem for stem in adapted if f"{stem}.weight" not in base_state)
    if missing:
        raise CheckpointError(f"{policy}: the adapter does not fit its base model {base} (no {missing[0]}.weight): "
                              "the base folder was replaced; give the folder the adapter was trained on")
    live = {(f"{lora.PREFIX}{k.removesuffix('.weight')}.base_layer.weight" if k.removesuffix(".weight") in adapted
             else f"{lora.PREFIX}{k}"): v for k, v in base_state.items()}
    return lora.merged_state({**live, **adapter}, config["lora_alpha"] / config["r"]), base
