"""Snapshots a trained worker keeps of itself: this rank's weights, optimizer state and RNG, copied into its
own host memory (or its own file), so a session can return to a point in well under a second without
gathering anything to the controller or to rank 0.

    worker.hold("s1")             # every rank of the role: its own shards
    ... steps ...
    worker.return_to("s1")        # bit-identical weights, optimizer state and RNG
    worker.weight_change("s1")    # {parameter: (|W - W_s1|^2, |W_s1|^2)} of this rank's shards
    worker.release("s1")

A mixin for workers with `self.model` and `self.optimizer` (the policy and the critic). Tensors are copied
into the existing parameters and optimizer state, never replaced: FSDP2's sharded parameters, the fused
optimizer's references and everything that points at them stay valid.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint_files import load_tensors
from .common import rng_state, set_rng_state


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP2 DTensor's shard; a plain tensor is all of itself)."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _copy(t):
    return _local(t).detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t


class SnapshotHolder:
    _held: dict

    def _snapshot_file(self, path: str) -> Path:
        from . import distributed as dist_util
        return Path(path) / f"{self.role}-rank{dist_util.rank()}.pt"

    def hold(self, key: str, path: str | None = None) -> int:
        """Copy this rank's weights, optimizer state and RNG under `key`: in memory, or into a file in the
        folder `path`. Returns the bytes held."""
        params = list(self.model.parameters())
        state = {
            "weights": [_copy(p) for p in params],
            "optimizer": {i: {k: _copy(v) for k, v in self.optimizer.state[p].items()}
                          for i, p in enumerate(params) if p in self.optimizer.state},
            "hyper": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "rng": rng_state(),
        }
        size = sum(t.numel() * t.element_size() for t in state["weights"])
        size += sum(v.numel() * v.element_size() for s in state["optimizer"].values() for v in s.values()
                    if isinstance(v, torch.Tensor))
        if not hasattr(self, "_held"):
            self._held = {}
        if path is not None:
            Path(path).mkdir(parents=True, exist_ok=True)
            torch.save(state, self._snapshot_file(path))
            self._held[key] = path
        else:
            self._held[key] = state
        return size

    def _state(self, key: str, path: str | None = None) -> dict:
        held = getattr(self, "_held", {}).get(key, path)  # on disk: a restarted worker reads it by its folder
        if held is None:
            raise KeyError(f"{self.role} holds no snapshot '{key}': it was released, or this worker was restarted "
                           "since it was taken (snapshots in memory live in the worker processes; "
                           "sess.snapshot(to_disk=True) survives a restart)")
        if isinstance(held, str):
            return load_tensors(self._snapshot_file(held), map_location="cpu")
        return held

    @torch.no_grad()
    def return_to(self, key: str, path: str | None = None) -> None:
        """Weights, optimizer state (moments, step counts, learning rate and the rest) and RNG as at `hold(key)`
        (`path`: the folder of a snapshot taken to disk, which a restarted worker no longer knows)."""
        from torch.distributed.tensor import DTensor
        state = self._state(key, path)
        params = list(self.model.parameters())
        for p, saved in zip(params, state["weights"], strict=True):
            _local(p).copy_(saved)
        for i, p in enumerate(params):
            saved = state["optimizer"].get(i)
            if saved is None:  # no step taken at that point
                self.optimizer.state.pop(p, None)
                continue
            current = self.optimizer.state[p]
            for k, v in saved.items():
                if not isinstance(v, torch.Tensor):
                    current[k] = v
                elif k in current and isinstance(current[k], torch.Tensor):
                    _local(current[k]).copy_(v)
                elif isinstance(p, DTensor) and v.shape == _local(p).shape:  # moments of a shard
                    current[k] = DTensor.from_local(v.to(_local(p).device), p.device_mesh, p.placements)
                else:
                    current[k] = v.to(_local(p).device) if v.dim() else v.clone()
        for group, hyper in zip(self.optimizer.param_groups, state["hyper"], strict=True):
            group.update(hyper)
        set_rng_state(state["rng"])

    @torch.no_grad()
    def weight_change(self, key: str) -> dict[str, tuple[float, float]]:
        """{parameter name: (squared norm of W - W_key, squared norm of W_key)} over this rank's shards;
        summed over ranks they give each parameter's relative change."""
        state = self._state(key)
        out = {}
        for (name, p), before in zip(self.model.named_parameters(), state["weights"], strict=True):
            now = _local(p).detach().to("cpu", torch.float64)
            before = before.to(torch.float64)
            out[name] = (float((now - before).pow(2).sum()), float(before.pow(2).sum()))
        return out

    def release(self, key: str) -> None:
        held = getattr(self, "_held", {}).pop(key, None)
        if isinstance(held, str):
            self._snapshot_file(held).unlink(missing_ok=True)
