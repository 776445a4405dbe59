"""Policy and reference workers: token log-probs, and the PPO-style policy update.

Plain Python classes: the `local` backend calls them in the kernel, the Ray backend wraps them in
actors. They take and return `Batch` objects holding one data-parallel shard.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..algos import agg_loss, entropy_from_logits, kl_penalty, ppo_policy_loss
from ..config import Config
from ..data.batch import Batch
from .common import (full_sequences, load_causal_lm, load_weights, read_safetensors, memory_snapshot, pick_device, response_hidden_slice,
                     rng_state, set_rng_state, token_logprobs)


class ReferenceWorker:
    """A frozen copy of the initial policy: log-probs for the KL term."""

    role = "reference"

    def __init__(self, cfg: Config, model_dir: str):
        self.cfg = cfg
        self.device = pick_device()
        self.model = load_causal_lm(model_dir, cfg.model.dtype, self.device)
        self.model.requires_grad_(False)
        self.model.eval()

    def _forward(self, batch: Batch, with_entropy: bool = False):
        ids, mask, pos = (t.to(self.device) for t in full_sequences(batch))
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits = logits[:, response_hidden_slice(batch)].float()
        if self.cfg.rollout.temperature > 0:  # score the distribution the rollout sampled from
            logits = logits / self.cfg.rollout.temperature
        lp = token_logprobs(logits, batch["response_ids_BR"].to(self.device))
        return lp, (entropy_from_logits(logits) if with_entropy else None)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, key: str = "ref_logprobs_BR") -> Batch:
        """{key: [B, R] log-probs of the response tokens}, computed in micro-batches."""
        parts = [self._forward(mb)[0].cpu() for mb in batch.split(self.cfg.train.micro_batch_size)]
        return Batch({key: torch.cat(parts)})

    def memory(self) -> dict:
        return memory_snapshot()


class PolicyWorker(ReferenceWorker):
    """The trained policy: log-probs under the current weights, and the clipped policy-gradient update."""

    role = "policy"

    def __init__(self, cfg: Config, model_dir: str):
        super().__init__(cfg, model_dir)
        self.model.requires_grad_(True)
        self.model.train()
        t = cfg.train
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=t.betas,
                                           weight_decay=t.weight_decay)

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
        n_steps = skipped = 0
        for _ in range(t.epochs):
            for mini in batch.chunk(t.mini_batches):
                stats = self._optimizer_step(mini, kl_coef)
                if stats is None:
                    skipped += 1
                    continue
                n_steps += 1
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        out = {k: v / max(n_steps, 1) for k, v in totals.items()}
        out["update/skipped"] = skipped
        return out

    def _optimizer_step(self, mini: Batch, kl_coef: float) -> dict | None:
        a = self.cfg.algo
        mask_all = mini["response_mask_BR"].float()
        counts = {"num_tokens": mask_all.sum(), "num_seqs": float(len(mini))}
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for mb in mini.split(self.cfg.train.micro_batch_size):
            mask = mb["response_mask_BR"].float().to(self.device)
            weight = mask.sum() / counts["num_tokens"]  # share of this micro-batch in the token-mean stats
            lp, ent = self._forward(mb, with_entropy=True)
            pg_BR, pg_stats = ppo_policy_loss(lp, mb["old_logprobs_BR"].to(self.device),
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
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                return None
            loss.backward()
            sums["loss/policy"] = sums.get("loss/policy", 0.0) + pg_loss.item()
            sums["entropy"] = sums.get("entropy", 0.0) + ent_loss.item()
            for k, v in pg_stats.items():
                sums[f"actor/{k}"] = sums.get(f"actor/{k}", 0.0) + v * weight.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        if not math.isfinite(grad_norm.item()):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        sums["actor/grad_norm"] = grad_norm.item()
        return sums

    # ---- weights and state ----------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full weights for the rollout engine (CPU copies: O(model size))."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save(self, path: str) -> None:
        """Weights as safetensors (a loadable HF model dir), optimizer and RNG state as tensors-only files."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(path), safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(), "rng": rng_state()}, path / "trainer_state.pt")

    def load(self, path: str) -> None:
        path = Path(path)
        load_weights(self.model, read_safetensors(path / "model.safetensors", self.device))
        extra = torch.load(path / "trainer_state.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(extra["optimizer"])
        set_rng_state(extra["rng"])
