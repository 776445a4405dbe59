"""Critic worker (PPO): a value head on the policy's backbone, trained with the clipped value loss."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..algos import agg_loss, value_loss
from ..checkpoint_files import load_tensors
from ..config import Config
from ..data.batch import Batch, trained_tokens
from ..metrics.memory import memory_snapshot
from ..ops.attention import load_model
from . import distributed as dist_util
from . import shards
from .common import DTYPES, disable_dropout, full_sequences, make_adamw, pick_device, response_hidden_slice
from .packing import SEQUENCE_FIELDS, micro_batches, pack_sequences, packs
from .snapshots import SnapshotHolder
from .trainer import adam_steps, optimizer_steps


class ValueModel(nn.Module):
    """Backbone of a causal LM (initialised from the policy, as is usual) + a scalar head per position."""

    def __init__(self, model_dir: str, dtype: str, attention: str, device: torch.device):
        super().__init__()
        from transformers import AutoModel
        self.backbone = load_model(AutoModel, model_dir, attention, device, dtype=DTYPES[dtype])
        self.head = nn.Linear(self.backbone.config.hidden_size, 1, dtype=DTYPES[dtype])
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        # no KV cache: transformers reads packed rows' restarting positions only without one (roles/packing.py)
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1).float().clone()  # not a view: FSDP2's backward hooks need a fresh tensor


class CriticWorker(SnapshotHolder):
    role = "critic"

    def __init__(self, cfg: Config, model_dir: str):
        self.cfg = cfg
        self.device = pick_device()
        compute = DTYPES[cfg.model.dtype]
        # fp32 masters, computed in model.dtype
        self.model = ValueModel(model_dir, "float32", cfg.model.attention, self.device).to(self.device)
        # from_pretrained leaves the backbone in eval mode, and transformers checkpoints activations only in
        # training mode: without this, train.activation_checkpointing kept every activation of the critic
        self.model.train()
        disable_dropout(self.model)  # its values in prepare and in the update: the same numbers on the same weights
        if cfg.train.activation_checkpointing:
            self.model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.sharded = dist_util.shard(self.model, self.device, compute_dtype=compute)
        self.autocast = compute != torch.float32 and not self.sharded
        t = cfg.train
        self.optimizer = make_adamw(self.model.parameters(), t.critic_lr, t.betas, t.weight_decay, self.sharded)

    def set_config(self, cfg: Config) -> None:
        """Settings that do not change shapes (a branch's value clip, lr, micro-batch size)."""
        self.cfg = cfg
        t = cfg.train
        for group in self.optimizer.param_groups:
            group.update(lr=t.critic_lr, betas=t.betas, weight_decay=t.weight_decay)

    def _values(self, batch: Batch) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=DTYPES[self.cfg.model.dtype], enabled=self.autocast):
            if packs(self.cfg.train.pack_sequences, batch["prompt_mask_BP"], batch["response_mask_BR"]):
                # padding-free rows (roles/packing.py); zero on padding
                rows = pack_sequences(*(batch[k].to(self.device) for k in SEQUENCE_FIELDS))
                return rows.scatter(self.model(rows.ids_NW, None, rows.positions_NW)[rows.rows_K, rows.cols_K])
            ids, mask, pos = (x.to(self.device) for x in full_sequences(batch))
            return self.model(ids, mask, pos)[:, response_hidden_slice(batch)]

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """{"values_BR": V(s_t) before each response token}, zeroed on padding."""
        parts = [(self._values(mb).cpu() * mb["response_mask_BR"]) for mb in micro_batches(batch, self.cfg.train)]
        return Batch({"values_BR": torch.cat(parts)})

    def update(self, batch: Batch) -> dict:
        """Epochs x mini-batches optimizer steps of the clipped value loss (roles/trainer.py); returns mean
        stats, `update/critic_skipped*` for steps a non-finite loss or gradient made it skip, and `adam_steps`."""
        return optimizer_steps(self.model, self.optimizer, batch, self.cfg.train, self._loss,
                               grad_norm_key="critic/grad_norm", skip_key="update/critic_skipped")

    def adam_steps(self) -> int:
        return adam_steps(self.model, self.optimizer)

    def _loss(self, mb: Batch, counts: dict) -> tuple[torch.Tensor, dict]:
        # the tokens counts' denominators count (the trainer's): an episode's model tokens, without a rejected one
        mask = trained_tokens(mb).float().to(self.device)
        vl_BR, st = value_loss(self._values(mb), mb["values_BR"].to(self.device), mb["returns_BR"].to(self.device),
                               mask, self.cfg.algo.value_clip)
        loss = agg_loss(vl_BR, mask, self.cfg.algo.loss_agg, **counts)
        share = (mask.sum() / counts["num_tokens"]).item()
        return loss, {"loss/value": loss.item(), "critic/vf_clip_frac": st["vf_clip_frac"] * share}

    def save(self, path: str) -> None:
        """Weights (value_model.safetensors on one rank) and optimizer state, each rank writing its own shards
        (roles/shards.py). Every rank must be called."""
        path = Path(path)
        shards.save_tensors(path, shards.model_state(self.model), self.sharded, file_name="value_model.safetensors")
        shards.save_optimizer(self.model, self.optimizer, path, self.sharded)

    def load(self, path: str) -> None:
        """What `save` wrote, by any number of ranks (or, from before sharded saves, a full state)."""
        path = Path(path)
        shards.load_model(self.model, path)
        if (path / "trainer_state.pt").exists():  # saved before sharded checkpoints
            extra = load_tensors(path / "trainer_state.pt", map_location="cpu" if self.sharded else self.device)
            dist_util.load_full_optimizer_state(self.model, self.optimizer, extra["optimizer"], self.sharded)
        else:
            shards.load_optimizer(self.model, self.optimizer, path)

    def memory(self) -> dict:
        return memory_snapshot()
