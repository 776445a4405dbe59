"""Rollout engine on Hugging Face `transformers` generate (KV cache): the CPU default.

Input: a Batch of left-padded prompts (`prompt_ids_BP`, `prompt_mask_BP`). Output: right-padded
responses (`response_ids_BR`, `response_mask_BR` = tokens up to and including the first EOS) and the
sampled tokens' log-probs under the sampling distribution (`rollout_logprobs_BR`).
"""
from __future__ import annotations

import torch

from ...config import Config, RolloutConfig
from ...data.batch import Batch
from ..common import load_causal_lm, load_weights, pick_device
from .base import RolloutWorker


class _SampledLogprobs:
    """A logits processor (last in the list) that records log p(sampled token) under the distribution the
    sampler drew from. At each step it sees the token drawn from the previous step's scores, so only one
    [B, V] log-softmax is alive at a time; `output_scores=True` would keep every step's [B, V] logits
    (20 GB for 512 samples x 64 tokens at V=152k)."""

    def __init__(self):
        self.prev_logp_BV: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _take(self, tokens_B: torch.Tensor) -> None:
        self.steps.append(self.prev_logp_BV.gather(-1, tokens_B[:, None]).squeeze(-1))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev_logp_BV is not None:
            self._take(input_ids[:, -1])
        self.prev_logp_BV = scores.float().log_softmax(-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, R] log-probs of the R generated tokens (the last one is taken from `sequences`)."""
        self._take(sequences[:, -1])
        self.prev_logp_BV = None
        return torch.stack(self.steps, dim=1)


class HFRolloutWorker(RolloutWorker):
    def __init__(self, cfg: Config, model_dir: str, eos_token_id: int, pad_token_id: int):
        self.cfg = cfg
        self.device = pick_device()
        self.model = load_causal_lm(model_dir, cfg.model.dtype, self.device)
        self.model.requires_grad_(False)
        self.model.eval()
        self.eos, self.pad = eos_token_id, pad_token_id
        self.weight_version = 0

    @torch.no_grad()
    def generate(self, batch: Batch, params: RolloutConfig | None = None) -> Batch:
        """Sample one response per row (rows are already repeated n times per prompt)."""
        p = params or self.cfg.rollout
        parts = [self._generate(mb, p) for mb in batch.split(p.micro_batch_size)]
        width = max(x["response_ids_BR"].shape[1] for x in parts)
        for x in parts:  # micro-batches may stop at different lengths: pad to one width
            pad = width - x["response_ids_BR"].shape[1]
            if pad:
                x["response_ids_BR"] = torch.nn.functional.pad(x["response_ids_BR"], (0, pad), value=self.pad)
                x["response_mask_BR"] = torch.nn.functional.pad(x["response_mask_BR"], (0, pad), value=0)
                x["rollout_logprobs_BR"] = torch.nn.functional.pad(x["rollout_logprobs_BR"], (0, pad), value=0.0)
        return Batch.cat(parts)

    def _generate(self, batch: Batch, p: RolloutConfig) -> Batch:
        from transformers import GenerationConfig, LogitsProcessorList
        from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                            TopPLogitsWarper)
        greedy = p.temperature == 0
        # the sampling warpers are ours, not generate()'s: HF puts its own after any custom processor,
        # and the log-prob recorder must see the final distribution the token is drawn from
        warpers = [] if greedy else ([TemperatureLogitsWarper(p.temperature)] if p.temperature != 1 else []) + \
            ([TopKLogitsWarper(p.top_k)] if p.top_k else []) + ([TopPLogitsWarper(p.top_p)] if p.top_p < 1 else [])
        recorder = _SampledLogprobs()
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else 1.0, top_p=None if greedy else 1.0,
            top_k=None if greedy else 0, max_new_tokens=p.max_new_tokens, eos_token_id=self.eos,
            pad_token_id=self.pad, return_dict_in_generate=True)
        ids = batch["prompt_ids_BP"].to(self.device)
        mask = batch["prompt_mask_BP"].to(self.device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                  logits_processor=LogitsProcessorList([*warpers, recorder]))
        resp = out.sequences[:, ids.shape[1]:]
        logprobs = recorder.finish(out.sequences)
        is_eos = resp == self.eos
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        resp_mask = (~after_eos).long()
        resp = resp.masked_fill(after_eos, self.pad)
        logprobs = torch.nan_to_num(logprobs * resp_mask, nan=0.0, neginf=0.0)
        return Batch({"response_ids_BR": resp.cpu(), "response_mask_BR": resp_mask.cpu(),
                      "rollout_logprobs_BR": logprobs.cpu()})

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> dict:
        """Load new policy weights in place; returns bytes moved. The first call checks that the names fit
        (`load_weights`); later ones with the same names copy tensor by tensor, with no state_dict walk."""
        if getattr(self, "_targets", None) is None or set(state) != self._names:
            load_weights(self.model, {k: v.to(self.device) for k, v in state.items()})
            self._names = set(state)
            self._targets = self.model.state_dict(keep_vars=True)
        else:
            with torch.no_grad():
                for k, v in state.items():
                    self._targets[k].copy_(v, non_blocking=True)
        self.weight_version = version
        return {"bytes": sum(v.numel() * v.element_size() for v in state.values())}

    def sleep(self) -> None:
        """Colocated mode: give the accelerator back to the trainers during the update (weights to host
        memory). A no-op on CPU."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        self.model.to(self.device)

