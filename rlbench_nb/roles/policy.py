"""Policy and reference workers: token log-probs, and the PPO-style policy update.

Plain Python classes: the `local` backend calls them in the kernel, the Ray backend wraps them in
actors. They take and return `Batch` objects holding one data-parallel shard.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..algos import agg_loss, kl_penalty, ppo_policy_loss
from ..config import Config
from ..data.batch import Batch
from ..metrics.memory import memory_snapshot
from . import distributed as dist_util
from .common import DTYPES, load_causal_lm, make_adamw, pick_device, read_safetensors, rng_state, set_rng_state
from ..checkpoint import load_tensors
from .scorer import TokenScorer


class ReferenceWorker:
    """A frozen copy of the initial policy: log-probs for the KL term."""

    role = "reference"
    trains = False

    def __init__(self, cfg: Config, model_dir: str):
        self.cfg = cfg
        self.device = pick_device()
        compute = DTYPES[cfg.model.dtype]
        # a trainer keeps fp32 master weights and computes in model.dtype; a frozen model just holds model.dtype
        self.model = load_causal_lm(model_dir, "float32" if self.trains else cfg.model.dtype, self.device)
        if self.trains and cfg.train.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.scorer = TokenScorer(self.model, cfg.train.logprob_chunk_mb, cfg.rollout.temperature, compute,
                                  autocast=False)
        # FSDP2 when this role has several ranks; its mixed-precision policy casts the fp32 masters
        self.sharded = dist_util.shard(self.scorer, self.device,
                                       compute_dtype=compute if self.trains else None)
        self.scorer.autocast = self.trains and compute != torch.float32 and not self.sharded
        # shared prompt prefixes go through a KV cache: not under FSDP2 (one forward per step per unit is
        # what it is built around) nor activation checkpointing (HF turns the cache off there)
        self.scorer.share_prefix = (cfg.train.share_prompt_prefix and not self.sharded
                                    and not (self.trains and cfg.train.activation_checkpointing))
        self.model.requires_grad_(self.trains)
        self.model.train(self.trains)

    def _forward(self, batch: Batch, with_entropy: bool = False):
        d = self.device
        return self.scorer(batch["prompt_ids_BP"].to(d), batch["prompt_mask_BP"].to(d),
                           batch["response_ids_BR"].to(d), batch["response_mask_BR"].to(d), with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, key: str = "ref_logprobs_BR") -> Batch:
        """{key: [B, R] log-probs of the response tokens}, computed in micro-batches."""
        parts = [self._forward(mb)[0].cpu() for mb in batch.split(self.cfg.train.micro_batch_size)]
        return Batch({key: torch.cat(parts)})

    def memory(self) -> dict:
        return memory_snapshot()

    def local_shards(self) -> dict[str, tuple[tuple, str]]:
        """(shape, dtype) of this rank's parameter shards (the full tensors when not sharded)."""
        from torch.distributed.tensor import DTensor
        local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in self.model.state_dict().items()}
        return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in local.items()}


class PolicyWorker(ReferenceWorker):
    """The trained policy: log-probs under the current weights, and the clipped policy-gradient update."""

    role = "policy"
    trains = True

    def __init__(self, cfg: Config, model_dir: str):
        super().__init__(cfg, model_dir)
        t = cfg.train
        self.optimizer = make_adamw(self.model.parameters(), t.lr, t.betas, t.weight_decay, self.sharded)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, key: str = "old_logprobs_BR") -> Batch:
        return super().compute_logprobs(batch, key)

    def update(self, batch: Batch, kl_coef: float) -> dict:
        """Epochs x mini-batches optimizer steps on this batch; returns mean stats.

        Each mini-batch's loss is normalised by the mini-batch's token/sequence counts, so micro-batching
        does not change the gradient. A non-finite loss or gradient skips that optimizer step (weights and
        optimizer state untouched) and is counted in `update/skipped`.
        """
        t = self.cfg.train
        totals: dict[str, float] = {}
        n_steps = 0
        skips = {"update/skipped_nonfinite_loss": 0, "update/skipped_nonfinite_grad": 0}
        for _ in range(t.epochs):
            for mini in batch.chunk(t.mini_batches):
                stats = self._optimizer_step(mini, kl_coef)
                if isinstance(stats, str):  # skipped: which number was not finite
                    skips[f"update/skipped_nonfinite_{stats}"] += 1
                    continue
                n_steps += 1
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        out = {k: v / max(n_steps, 1) for k, v in totals.items()}
        out["update/skipped"] = sum(skips.values())
        out.update(skips)
        return out

    def _optimizer_step(self, mini: Batch, kl_coef: float) -> dict | str:
        """One optimizer step over `mini` (in micro-batches): its stats, or "loss" / "grad" when a
        non-finite loss or gradient norm made it skip (weights and optimizer state untouched)."""
        a = self.cfg.algo
        # denominators of the whole mini-batch across ranks: shards' losses then add up to the global loss
        counts = {"num_tokens": dist_util.all_reduce_sum(mini["response_mask_BR"].float().sum()),
                  "num_seqs": dist_util.all_reduce_sum(torch.tensor(float(len(mini))))}
        world = dist_util.world_size()  # FSDP averages gradients over ranks; scale back to a sum
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for mb in mini.split(self.cfg.train.micro_batch_size):
            mask = mb["response_mask_BR"].float().to(self.device)
            weight = mask.sum() / counts["num_tokens"]  # share of this micro-batch in the token-mean stats
            lp, ent = self._forward(mb, with_entropy=True)
            # without old log-probs (algo.reuse_logprobs) the policy is the one that sampled: ratio 1
            old = mb["old_logprobs_BR"].to(self.device) if "old_logprobs_BR" in mb else lp.detach()
            pg_BR, pg_stats = ppo_policy_loss(lp, old,
                                              mb["advantages_BR"].to(self.device), mask,
                                              a.clip_low, a.clip_high, a.dual_clip)
            pg_loss = agg_loss(pg_BR, mask, a.loss_agg, **counts)
            loss = pg_loss
            ent_loss = agg_loss(ent, mask, a.loss_agg, **counts)
            if a.entropy_coef > 0:
                loss = loss - a.entropy_coef * ent_loss
            if kl_coef > 0 and a.kl_in == "loss":
                kl_BR = kl_penalty(lp, mb["ref_logprobs_BR"].to(self.device), a.kl_estimator)
                kl_loss = agg_loss(kl_BR, mask, a.loss_agg, **counts)
                loss = loss + kl_coef * kl_loss
                sums["loss/kl"] = sums.get("loss/kl", 0.0) + kl_loss.item()
            # every rank must take the same branch: FSDP's backward is a collective
            if dist_util.all_reduce_sum(torch.tensor(0.0 if torch.isfinite(loss) else 1.0)) > 0:
                self.optimizer.zero_grad(set_to_none=True)
                return "loss"
            (loss * world).backward()
            sums["loss/policy"] = sums.get("loss/policy", 0.0) + pg_loss.item()
            sums["entropy"] = sums.get("entropy", 0.0) + ent_loss.item()
            for k, v in pg_stats.items():
                sums[f"actor/{k}"] = sums.get(f"actor/{k}", 0.0) + v * weight.item()
        grad_norm = dist_util.local_scalar(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return "grad"
        self.optimizer.step()
        keys = sorted(sums)  # shards' contributions -> the mini-batch's values, the same on every rank
        totals = dist_util.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        out = dict(zip(keys, totals.tolist()))
        out["actor/grad_norm"] = grad_norm
        return out

    # ---- weights and state ----------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU weights in the rollout's dtype (model.dtype) on rank 0 ({} elsewhere); gathers when
        sharded: O(model size). Every rank must be called."""
        dtype = DTYPES[self.cfg.model.dtype]
        return {k: v.to(dtype) for k, v in dist_util.full_model_state(self.model, self.sharded).items()}

    def save(self, path: str) -> None:
        """Weights as safetensors (a loadable HF model dir), optimizer and RNG state as tensors-only files.
        Every rank must be called (gathers when sharded); rank 0 writes."""
        state = dist_util.full_model_state(self.model, self.sharded)
        optim = dist_util.full_optimizer_state(self.model, self.optimizer, self.sharded)
        if dist_util.rank() == 0:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            dist_util.save_model_dir(self.model, state, path)
            torch.save({"optimizer": optim, "rng": rng_state()}, path / "trainer_state.pt")

    def load(self, path: str) -> None:
        path = Path(path)
        state = read_safetensors(path / "model.safetensors", "cpu" if self.sharded else self.device)
        dist_util.load_full_model_state(self.model, state, self.sharded)
        extra = load_tensors(path / "trainer_state.pt", map_location="cpu" if self.sharded else self.device)
        dist_util.load_full_optimizer_state(self.model, self.optimizer, extra["optimizer"], self.sharded)
        set_rng_state(extra["rng"])
