"""A trainer's weights and optimizer state on disk: each rank writes its own shards, any number of ranks reads
them back.

    <folder>/                    weights
      model.safetensors            one rank: the whole model (save_pretrained's file, from_pretrained loads it)
      shard-0000k-model-00001-of-00001.safetensors   sharded (FSDP2): rank k-1's own pieces
      optimizer/                   the optimizer's tensors (exp_avg, exp_avg_sq, step per weight), laid out as
        *.safetensors              the weights are, and param_groups.json (learning rate, betas, ... per group)

Sharded saves go through `torch.distributed.checkpoint` with its Hugging Face storage: every rank writes the
pieces it holds, and each file's safetensors header (JSON) records where its pieces sit in the whole tensor — no
gather onto rank 0, and no pickled `.metadata` file (DCP's default). Loading plans from those headers alone:
each rank reads the slices its own layout needs, so a checkpoint saved by 2 ranks loads onto 1, 2 or 3 (or
from one rank's whole files onto several). Nothing here unpickles anything: safetensors and JSON only.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..checkpoint import CheckpointError
from . import distributed as dist_util

OPTIMIZER = "optimizer"
GROUPS_FILE = "param_groups.json"


def save_tensors(folder: Path, state: dict[str, torch.Tensor], sharded: bool,
                 file_name: str = "model.safetensors") -> None:
    """Write `state` ({name: tensor or DTensor}) into `folder`: sharded, each rank its own pieces (a collective:
    every rank must call it); otherwise one whole file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not sharded:
        from safetensors.torch import save_file
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(folder / file_name))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def load_tensors_into(folder: Path, target: dict[str, torch.Tensor]) -> None:
    """Fill `target` ({name: tensor or DTensor} in this rank's layout) in place from the safetensors files in
    `folder`, whatever layout wrote them. A name the files lack, or a shape they disagree on, is an error
    naming it."""
    folder = Path(folder)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder} holds no .safetensors files")
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with warnings.catch_warnings():  # one process without a process group is how the local backend loads
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, storage_reader=HuggingFaceStorageReader(str(folder)))
    except (Exception, CheckpointException) as e:  # DCP's wraps each rank's error (a BaseException)
        raise CheckpointError(f"the tensors in {folder} do not fit this model ({_cause(e)}): load it with the model "
                          "settings it was saved with") from None


def _cause(e: BaseException) -> str:
    """The underlying error's own line from DCP's per-rank report (e.g. 'Size mismatch between saved
    torch.Size([37, 24]) and current: torch.Size([37, 32]) for lm_head.weight')."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in reversed(lines):
        head, sep, rest = line.partition(": ")
        if sep and head.replace(".", "").isidentifier() and head.endswith(("Error", "Exception")):
            return rest
    return lines[-1] if lines else type(e).__name__


def whole_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in `folder` whole, on the CPU, however many ranks wrote it (for a model folder of one's own:
    `rlbench-nb weights`). Its shapes and dtypes come from the files' headers."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    meta = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    state = {name: torch.empty(m.size, dtype=m.properties.dtype) for name, m in meta.items()}
    load_tensors_into(folder, state)
    return state


# ---- weights --------------------------------------------------------------------------------------
def model_state(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """This rank's weights by name (DTensors when sharded), tied duplicates left out (HF saves a tied
    `lm_head.weight` as the embedding alone). No copy, no gather."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    seen, out = set(), {}
    for name, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.numel() and local.untyped_storage().data_ptr() in seen:
            continue
        seen.add(local.untyped_storage().data_ptr())
        out[name] = value
    return out


def load_model(model: torch.nn.Module, folder: Path) -> None:
    """The weights in `folder`, saved by any number of ranks, into `model` as it is sharded now."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    state = model_state(model)
    load_tensors_into(folder, state)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


# ---- optimizer ------------------------------------------------------------------------------------
def _flat_optimizer(model, optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """({"<weight name>/<exp_avg|exp_avg_sq|step>": tensor}, param_groups with weight names), this rank's
    pieces. A fresh optimizer's state is made first (zeros), so a load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    osd = get_optimizer_state_dict(model, optimizer)
    flat = {}
    for name, per_weight in osd["state"].items():
        for key, value in per_weight.items():
            flat[f"{name}/{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return flat, osd["param_groups"]


def save_optimizer(model, optimizer, folder: Path, sharded: bool) -> None:
    """The optimizer's tensors as the weights are saved (each rank its pieces) + param_groups.json (rank 0).
    A collective when sharded."""
    flat, groups = _flat_optimizer(model, optimizer)
    save_tensors(Path(folder) / OPTIMIZER, flat, sharded, file_name="optimizer.safetensors")
    if dist_util.rank() == 0:
        plain = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]
        (Path(folder) / OPTIMIZER / GROUPS_FILE).write_text(json.dumps(plain, indent=1))


def load_optimizer(model, optimizer, folder: Path) -> None:
    """The optimizer state in `folder`, saved by any number of ranks, into `optimizer` as it is sharded now."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    folder = Path(folder) / OPTIMIZER
    try:
        groups = json.loads((folder / GROUPS_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {folder / GROUPS_FILE}: {e}") from None
    flat, own_groups = _flat_optimizer(model, optimizer)
    if len(groups) != len(own_groups) or any(sorted(g["params"]) != sorted(o["params"])
                                             for g, o in zip(groups, own_groups)):
        raise CheckpointError(f"the optimizer state in {folder} is for other weights than this model trains "
                          "(another model, or LoRA on/off): load it with the config it was saved with")
    load_tensors_into(folder, flat)
    state: dict[str, dict] = {}
    for key, value in flat.items():
        name, _, field = key.rpartition("/")
        state.setdefault(name, {})[field] = value
    for g in groups:
        g.update({k: tuple(v) for k, v in g.items() if k == "betas"})
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups})
