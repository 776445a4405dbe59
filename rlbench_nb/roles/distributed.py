"""torch.distributed helpers for the trainer roles: FSDP2 sharding and full state dicts.

Under the `local` backend no process group exists and every helper is the plain single-process
version; under Ray the actor wrapper has already called `init_process_group` (gloo on CPU, NCCL on
GPU), so the same worker class shards itself with FSDP2.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def shard(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype | None = None) -> bool:
    """FSDP2 (`fully_shard`) each decoder layer, then the root, over all ranks. Returns whether it sharded.

    `compute_dtype` (e.g. bf16) turns on FSDP2's mixed precision: parameters stay fp32 (the master copy
    the optimizer updates), are all-gathered and computed in `compute_dtype`, and gradients are
    reduce-scattered in fp32. The mesh is built explicitly on the model's device type: the default mesh
    picks CUDA when present even for a gloo group.
    """
    if world_size() == 1:
        return False
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (world_size(),))
    mp = MixedPrecisionPolicy()
    if compute_dtype is not None and compute_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), [])
    for layer in layers:  # one FSDP unit per decoder layer: gathers one layer's weights at a time
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return True


def local_scalar(x) -> float:
    """A Python float from a tensor or DTensor (clip_grad_norm_ returns a DTensor under FSDP2)."""
    from torch.distributed.tensor import DTensor
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(x)


def full_model_state(model: torch.nn.Module, sharded: bool, trainable_only: bool = False,
                     copy: bool = True) -> dict[str, torch.Tensor]:
    """Full CPU weights on rank 0 ({} on other ranks); `trainable_only`: those that require grad (LoRA's
    adapters); `copy=False`: unsharded CPU weights as the model's own tensors, not copies. A collective when
    sharded: every rank must call it."""
    if not sharded:
        trained = {n for n, p in model.named_parameters() if p.requires_grad} if trainable_only else None
        return {k: v.detach().to("cpu", copy=copy) for k, v in model.state_dict().items()
                if trained is None or k in trained}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trainable_only))


def load_full_model_state(model: torch.nn.Module, state: dict, sharded: bool, partial: bool = False) -> None:
    """Copy full (unsharded) `state` into `model`; `partial`: only some of its weights (LoRA's adapters),
    each of which must exist in the model."""
    from .common import load_weights
    if partial:
        unknown = sorted(set(state) - set(model.state_dict()))
        if unknown:
            raise ValueError(f"weights do not fit the model: unexpected {unknown[:5]}")
    if not sharded:
        if partial:
            model.load_state_dict(state, strict=False)
        else:
            load_weights(model, state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=not partial))


def full_optimizer_state(model, optimizer, sharded: bool) -> dict:
    if not sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model, optimizer, state: dict, sharded: bool) -> None:
    if not sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
