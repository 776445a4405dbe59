"""Policy and reference workers: token log-probs, and the PPO-style policy update.

Plain Python classes: the `local` backend calls them in the kernel, the Ray backend wraps them in
actors. They take and return `Batch` objects holding one data-parallel shard.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..algos import POLICY_LOSSES, agg_loss, kl_penalty, policy_loss
from ..checkpoint_files import load_tensors
from ..config import Config
from ..data.batch import Batch, trained_tokens
from ..metrics.memory import memory_snapshot
from . import distributed as dist_util
from . import lora as lora_util
from . import shards, tinker_ops
from .common import (
    DTYPES,
    copy_tokenizer_files,
    disable_dropout,
    load_causal_lm,
    make_adamw,
    pick_device,
    read_safetensors,
    rng_state,
    set_rng_state,
)
from .packing import micro_batches
from .scorer import TokenScorer
from .snapshots import SnapshotHolder
from .trainer import adam_steps, optimizer_steps


class ReferenceWorker:
    """A frozen copy of the initial policy: log-probs for the KL term."""

    role = "reference"
    trains = False

    def __init__(self, cfg: Config, model_dir: str):
        self.cfg = cfg
        self.model_dir = model_dir
        self.device = pick_device()
        compute = DTYPES[cfg.model.dtype]
        # a trainer keeps fp32 master weights and computes in model.dtype; a frozen model just holds model.dtype
        self.model = load_causal_lm(model_dir, "float32" if self.trains else cfg.model.dtype, self.device,
                                    cfg.model.attention)
        if self.trains:  # it stays in training mode, where its no-grad passes would sample dropout noise
            disable_dropout(self.model)
        self.lora = cfg.model.lora if self.trains and cfg.model.lora.r else None
        if self.lora:  # adapters only train; the base stays frozen (and is the reference: reference_logprobs)
            self.model = lora_util.add_adapters(self.model, self.lora, cfg.run.seed)
            self.base_fingerprint = lora_util.base_fingerprint(self.model)
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
        self.scorer.pack = cfg.train.pack_sequences
        if not self.lora:  # peft has frozen all but the adapters
            self.model.requires_grad_(self.trains)
        self.model.train(self.trains)

    def _forward(self, batch: Batch, with_entropy: bool = False):
        d = self.device
        return self.scorer(batch["prompt_ids_BP"].to(d), batch["prompt_mask_BP"].to(d),
                           batch["response_ids_BR"].to(d), batch["response_mask_BR"].to(d), with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, key: str = "ref_logprobs_BR") -> Batch:
        """{key: [B, R] log-probs of the response tokens}, computed in micro-batches."""
        parts = [self._forward(mb)[0].cpu() for mb in micro_batches(batch, self.cfg.train)]
        return Batch({key: torch.cat(parts)})

    def memory(self) -> dict:
        return memory_snapshot()

    def set_config(self, cfg: Config) -> None:
        """Settings that do not change shapes (a branch's algorithm, loss, sampling temperature, lr)."""
        self.cfg = cfg
        self.scorer.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.scorer.pack = cfg.train.pack_sequences

    def local_shards(self) -> dict[str, tuple[tuple, str]]:
        """(shape, dtype) of this rank's parameter shards (the full tensors when not sharded)."""
        from torch.distributed.tensor import DTensor
        local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in self.model.state_dict().items()}
        return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in local.items()}


class PolicyWorker(SnapshotHolder, ReferenceWorker):
    """The trained policy: log-probs under the current weights, and the clipped policy-gradient update."""

    role = "policy"
    trains = True

    def __init__(self, cfg: Config, model_dir: str):
        super().__init__(cfg, model_dir)
        t = cfg.train
        params = lora_util.trainable_parameters(self.model) if self.lora else self.model.parameters()
        self.optimizer = make_adamw(params, t.lr, t.betas, t.weight_decay, self.sharded)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, key: str = "old_logprobs_BR") -> Batch:
        return super().compute_logprobs(batch, key)

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch) -> Batch:
        """With LoRA the reference is this very model with its adapters off: no second copy of the weights."""
        if not self.lora:
            raise RuntimeError("reference_logprobs is the LoRA policy's; without adapters the reference role scores")
        with self.model.disable_adapter():
            return ReferenceWorker.compute_logprobs(self, batch, "ref_logprobs_BR")

    def set_config(self, cfg: Config) -> None:
        super().set_config(cfg)
        t = cfg.train
        for group in self.optimizer.param_groups:
            group.update(lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)

    def update(self, batch: Batch, kl_coef: float) -> dict:
        """Epochs x mini-batches optimizer steps on this batch (roles/trainer.py); returns mean stats, and
        `update/skipped*` for steps a non-finite loss or gradient made it skip, and `adam_steps`."""
        return optimizer_steps(self.model, self.optimizer, batch, self.cfg.train,
                               lambda mb, counts: self._loss(mb, counts, kl_coef),
                               grad_norm_key="actor/grad_norm", skip_key="update/skipped")

    def _loss(self, mb: Batch, counts: dict, kl_coef: float) -> tuple[torch.Tensor, dict]:
        """The clipped policy-gradient loss (+ entropy bonus, + KL loss) of a micro-batch, as its share
        of the mini-batch's loss; and its share of each statistic."""
        a = self.cfg.algo
        mask = trained_tokens(mb).float().to(self.device)  # the model's own tokens (episodes: not the env's)
        share = (mask.sum() / counts["num_tokens"]).item()  # of the token-mean statistics
        lp, ent = self._forward(mb, with_entropy=True)
        # without old log-probs (algo.reuse_logprobs) the policy is the one that sampled: ratio 1
        old = mb["old_logprobs_BR"].to(self.device) if "old_logprobs_BR" in mb else lp.detach()
        pg_BR, pg_stats = policy_loss(a.policy_loss, lp, old, mb["advantages_BR"].to(self.device), mask, a)
        if "is_weights_BR" in mb:  # algo.rollout_is: the engine sampled from q, not from the trainer's p
            pg_BR = pg_BR * mb["is_weights_BR"].to(self.device)
        pg_loss = agg_loss(pg_BR, mask, a.loss_agg, **counts)
        ent_loss = agg_loss(ent, mask, a.loss_agg, **counts)
        loss = pg_loss - a.entropy_coef * ent_loss if a.entropy_coef > 0 else pg_loss
        stats = {"loss/policy": pg_loss.item(), "entropy": ent_loss.item(),
                 **{f"actor/{k}": v * share for k, v in pg_stats.items()}}
        if "old_logprobs_BR" not in mb and "rollout_logprobs_BR" in mb:  # reused: this forward is the trainer's
            stats.update(_mismatch_shares(lp.detach(), mb["rollout_logprobs_BR"].to(self.device), mask, counts))
        if "old_logprobs_BR" not in mb and "ref_logprobs_BR" in mb:  # reused: the KL to the reference from here too
            stats.update(_reference_kl_shares(lp.detach(), mb["ref_logprobs_BR"].to(self.device), mask, counts,
                                              a.kl_estimator))
        if kl_coef > 0 and a.kl_in == "loss":
            kl_loss = agg_loss(kl_penalty(lp, mb["ref_logprobs_BR"].to(self.device), a.kl_estimator), mask,
                               a.loss_agg, **counts)
            loss = loss + kl_coef * kl_loss
            stats["loss/kl"] = kl_loss.item()
        return loss, stats

    def register_policy_loss(self, name: str, fn) -> None:
        """A loss defined in the controller (`@sess.policy_loss`), shipped here by name."""
        POLICY_LOSSES[name] = fn

    def adam_steps(self) -> int:
        return adam_steps(self.model, self.optimizer)

    def tinker_forward_backward(self, batch: Batch, loss_fn: str, loss_cfg: dict, forward_only: bool) -> dict:
        """The Tinker API's forward_backward on this rank's datums (roles/tinker_ops.py): gradients accumulate."""
        return tinker_ops.forward_backward(self, batch, loss_fn, loss_cfg, forward_only)

    def tinker_optim_step(self, adam: dict, expect_gradients: bool) -> dict:
        """The Tinker API's optim_step: one AdamW step with the request's hyperparameters (roles/tinker_ops.py)."""
        return tinker_ops.optim_step(self, adam, expect_gradients)

    def tinker_zero_grad(self) -> None:
        """Drop a Tinker client's accumulated gradients (its forward_backward failed, or it went away)."""
        tinker_ops.zero_grad(self)

    # ---- weights and state ----------------------------------------------------------------------
    def get_weights(self, copy: bool = True, dtype: str | None = None) -> dict[str, torch.Tensor]:
        """Full CPU weights in `dtype` (default model.dtype; a push sends the rollout engine's) on rank 0 ({}
        elsewhere); gathers when sharded: O(model size). With LoRA: the base model's weights with the adapters
        merged in. Every rank must be called. `copy=False`, for a weight push whose receiver copies them at once:
        the live tensors where no gather or cast makes new ones (a copy of the model a step saved, 0.5 GB at 135M)."""
        dtype = DTYPES[dtype or self.cfg.model.dtype]
        state = dist_util.full_model_state(self.model, self.sharded, copy=copy)
        if self.lora and state:
            state = lora_util.merged_state(state, lora_util.scaling(self.lora))
        return {k: v.to(dtype) for k, v in state.items()}

    def save(self, path: str) -> None:
        """Weights, optimizer state and RNG state into `path`, each rank writing its own shards (roles/shards.py:
        no rank gathers the model; any number of ranks loads them back). One rank writes a from_pretrained-
        loadable model.safetensors; with LoRA the adapter alone, a peft adapter dir. Every rank must be called."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        extra = {"rng": rng_state()}
        if self.lora:  # the adapters are small: gathered, adapter_model.safetensors + adapter_config.json
            state = dist_util.full_model_state(self.model, self.sharded, trainable_only=True)
            if dist_util.rank() == 0:
                from safetensors.torch import save_file
                save_file(lora_util.adapter_state(state), str(path / "adapter_model.safetensors"))
                self.model.peft_config[lora_util.ADAPTER].save_pretrained(str(path))
            extra["base_fingerprint"] = self.base_fingerprint
        else:  # with the tokenizer's files: a model folder of its own (sharded: `rlbench-nb weights` joins it)
            if self.sharded:
                shards.save_tensors(path, shards.model_state(self.model), sharded=True)
            if dist_util.rank() == 0:
                if self.sharded:
                    self.model.config.save_pretrained(str(path))
                    if self.model.can_generate() and self.model.generation_config is not None:
                        self.model.generation_config.save_pretrained(str(path))
                else:
                    self.model.save_pretrained(str(path))  # config, generation config, model.safetensors
                copy_tokenizer_files(self.model_dir, path)
        shards.save_optimizer(self.model, self.optimizer, path, self.sharded)
        if dist_util.rank() == 0:
            torch.save(extra, path / "trainer_state.pt")

    def load(self, path: str) -> None:
        """What `save` wrote, by this or any other number of ranks (a checkpoint from before sharded saves
        keeps its full optimizer state, loadable onto the rank count it was saved with)."""
        path = Path(path)
        extra = load_tensors(path / "trainer_state.pt", map_location="cpu")
        if self.lora:
            self._load_adapter(path, extra)
        else:
            shards.load_model(self.model, path)
        if "optimizer" in extra:
            dist_util.load_full_optimizer_state(self.model, self.optimizer, extra["optimizer"], self.sharded)
        else:
            shards.load_optimizer(self.model, self.optimizer, path)
        set_rng_state(extra["rng"])

    def _load_adapter(self, path: Path, extra: dict) -> None:
        if not (path / "adapter_model.safetensors").exists():
            raise ValueError(f"{path} holds no adapter (adapter_model.safetensors): it was saved without "
                             "model.lora; load it with the config it was saved with")
        if not torch.equal(extra["base_fingerprint"].cpu(), self.base_fingerprint.cpu()):
            raise ValueError(f"the adapter in {path} was trained on another base model than "
                             f"{self.cfg.model.path or 'the task model'} holds now: load it onto the base it was "
                             "saved with (its adapter_config.json names it)")
        adapter = lora_util.adapter_to_model_names(read_safetensors(path / "adapter_model.safetensors", "cpu"))
        dist_util.load_full_model_state(self.model, adapter, self.sharded, partial=True)


def _reference_kl_shares(logprobs_BR: torch.Tensor, ref_BR: torch.Tensor, mask: torch.Tensor, counts: dict,
                         estimator: str) -> dict:
    """What prepare() measures from the old log-probs when it has them (algos.reference_kl), as this micro-batch's
    shares: `kl/ref`, the token mean, and `kl_current`, the mean over sequences of their token mean (what the
    adaptive KL controller tracks; the session takes it out of the metrics)."""
    kl = kl_penalty(logprobs_BR, ref_BR, estimator) * mask
    per_seq = kl.sum(-1) / mask.sum(-1).clamp(min=1e-8)
    return {"kl/ref": (kl.sum() / counts["num_tokens"]).item(),
            "kl_current": (per_seq.sum() / counts["num_seqs"]).item()}


def _mismatch_shares(trainer_BR: torch.Tensor, rollout_BR: torch.Tensor, mask: torch.Tensor, counts: dict) -> dict:
    """algos.mismatch_metrics as this micro-batch's shares of the mini-batch's values (they add up over
    micro-batches and ranks; `_max` statistics are maxima: roles/trainer.py reduces them so)."""
    delta = (trainer_BR - rollout_BR).clamp(-20, 20) * mask
    per_seq = delta.sum(-1) / mask.sum(-1).clamp(min=1)
    has_tokens = (mask.sum(-1) > 0).float()
    seq_err = ((torch.exp(per_seq) - 1).abs() * has_tokens).sum()
    return {"mismatch/logp_abs_mean": (delta.abs().sum() / counts["num_tokens"]).item(),
            "mismatch/logp_abs_max": delta.abs().max().item(),
            "mismatch/prob_ratio_err": (seq_err / counts["num_seqs"]).item(),
            "mismatch/kl_k3": (((torch.exp(delta) - 1 - delta) * mask).sum() / counts["num_tokens"]).item()}
