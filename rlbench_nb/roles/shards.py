"""A trainer's weights and optimizer state on disk: each rank writes its own shards, any number of ranks reads
them back.

    <folder>/                    weights
      model.safetensors            one rank: the whole model (save_pretrained's file, from_pretrained loads it)
      shard-0000k-model-00001-of-00001.safetensors   sharded (FSDP2): rank k-1's own pieces
      shards.json                  sharded: how many ranks wrote, each tensor's whole shape (a load checks both)
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

from ..checkpoint_files import CheckpointError
from . import distributed as dist_util

OPTIMIZER = "optimizer"
GROUPS_FILE = "param_groups.json"
LAYOUT_FILE = "shards.json"


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
    if dist_util.rank() == 0:  # what a load checks the files against: one file per rank, each tensor's shape
        (folder / LAYOUT_FILE).write_text(json.dumps(
            {"ranks": dist_util.world_size(), "shapes": {k: list(v.shape) for k, v in state.items()}}))


def stored(folder: Path) -> dict:
    """{name: DCP's TensorStorageMetadata (size, dtype, the pieces' offsets and sizes)} from the files' headers
    alone; an error naming the tensor when the pieces do not cover it whole (a rank's file is missing)."""
    from math import prod

    from torch.distributed.checkpoint import HuggingFaceStorageReader
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder} holds no .safetensors files")
    meta = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    layout = json.loads((folder / LAYOUT_FILE).read_text()) if (folder / LAYOUT_FILE).exists() else None
    files = sorted(f.name for f in folder.glob("shard-*.safetensors"))
    missing = "a rank's shard file is missing (on several machines the checkpoint folder must be on a filesystem " \
              f"every node sees); files there: {files}"
    if layout and len(files) != layout["ranks"]:
        raise CheckpointError(f"{folder} was saved by {layout['ranks']} ranks but holds {len(files)} shard files: "
                              + missing)
    for name, m in meta.items():  # the reader takes a tensor's size from its furthest piece: count the rest
        size = list(layout["shapes"].get(name, m.size) if layout else m.size)
        held = sum(prod(c.sizes) for c in m.chunks)
        if held != prod(size) or list(m.size) != size:
            raise CheckpointError(f"{folder} holds {held} of the {prod(size)} values of {name}: " + missing)
    return meta


def load_tensors_into(folder: Path, target: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    """Fill `target` ({name: tensor or DTensor} in this rank's layout) in place from the safetensors files in
    `folder`, whatever layout wrote them. A name the files lack, or a shape they disagree on, is an error
    naming it. `meta`: what `stored(folder)` returned, when the caller has read it already."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException
    meta = stored(folder) if meta is None else meta
    for name, value in target.items():
        if name not in meta:
            raise CheckpointError(f"the tensors in {folder} do not fit this model (no {name}): load it with the "
                                  "model settings it was saved with")
        if tuple(meta[name].size) != tuple(value.shape):
            raise CheckpointError(f"the tensors in {folder} do not fit this model ({name} was saved with shape "
                                  f"{list(meta[name].size)}, this model's is {list(value.shape)}): load it with "
                                  "the model settings it was saved with")
    try:
        with warnings.catch_warnings():  # one process without a process group is how the local backend loads
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, storage_reader=HuggingFaceStorageReader(str(folder)))
    except (Exception, CheckpointException) as e:  # DCP's wraps each rank's error (a BaseException)
        raise CheckpointError(f"cannot load the tensors in {folder}: {_cause(e)}") from None


def _cause(e: BaseException) -> str:
    """The underlying error's own line from DCP's per-rank report."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in reversed(lines):
        head, sep, rest = line.partition(": ")
        if sep and head.replace(".", "").isidentifier() and head.endswith(("Error", "Exception")):
            return f"{head}: {rest}"
    return lines[-1] if lines else type(e).__name__


def whole_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in `folder` whole, on the CPU, however many ranks wrote it (for a model folder of one's own:
    `rlbench-nb weights`). Its shapes and dtypes come from the files' headers."""
    meta = stored(folder)
    state = {name: torch.empty(m.size, dtype=m.properties.dtype) for name, m in meta.items()}
    load_tensors_into(folder, state, meta)
    return state


# ---- weights --------------------------------------------------------------------------------------
def model_state(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """This rank's weights by name (DTensors when sharded), tied duplicates left out (HF saves a tied
    `lm_head.weight` as the embedding alone). No copy, no gather."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    # a tied weight is one parameter under two names: keep the first name, the same on every rank
    aliases = ({n for n, _ in model.named_parameters(remove_duplicate=False)}
               - {n for n, _ in model.named_parameters()})
    return {name: value for name, value in state.items() if name not in aliases}


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
    optimizer.zero_grad(set_to_none=True)  # torch makes a fresh state only where no gradient is left over
    flat, own_groups = _flat_optimizer(model, optimizer)
    if len(groups) != len(own_groups) or any(sorted(g["params"]) != sorted(o["params"])
                                             for g, o in zip(groups, own_groups)):
        raise CheckpointError(f"the optimizer state in {folder} is for other weights than this model trains "
                          "(another model, or LoRA on/off): load it with the config it was saved with")
    saved = stored(folder)
    if set(saved) != set(flat):
        raise CheckpointError(f"the optimizer state in {folder} is for other weights than this model trains "
                              f"({len(saved)} tensors saved, {len(flat)} here): load it with the config it was "
                              "saved with")
    load_tensors_into(folder, flat, saved)
    state: dict[str, dict] = {}
    for key, value in flat.items():
        name, _, field = key.rpartition("/")
        state.setdefault(name, {})[field] = value
    for g, own in zip(groups, own_groups):
        g.update({k: tuple(v) for k, v in g.items() if k == "betas"})
        # how this optimizer runs is its own (the fused kernel for plain tensors, not for FSDP2's DTensors)
        g.update({k: own[k] for k in ("fused", "foreach", "capturable", "differentiable") if k in own})
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups})
