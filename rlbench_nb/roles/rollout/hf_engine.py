"""Rollout engine on a Hugging Face `transformers` model with its KV cache: the CPU default.

Input: a Batch of left-padded prompts (`prompt_ids_BP`, `prompt_mask_BP`). Output: right-padded
responses (`response_ids_BR`, `response_mask_BR` = tokens up to and including the first EOS) and the
sampled tokens' log-probs under the sampling distribution (`rollout_logprobs_BR`).
"""
from __future__ import annotations

import torch

from ...config import Config, RolloutConfig
from ...data.batch import Batch
from ...determinism import sampling_generator
from ...ops.precision import rollout_dtype
from ..common import DTYPES, load_causal_lm, load_weights, pick_device
from .base import RolloutWorker
from .decode_step import decode_step_for, model_step
from .kv_cache import reserved_cache
from .sampling import sample_next
from .skinny_linear import use_skinny_linears


class HFRolloutWorker(RolloutWorker):
    def __init__(self, cfg: Config, model_dir: str, eos_token_id: int, pad_token_id: int):
        self.cfg = cfg
        self.model_dir = model_dir
        self.device = pick_device()
        self.model = load_causal_lm(model_dir, cfg.model.dtype, self.device, cfg.model.attention)
        # rollout.dtype: by default bf16 where the CPU computes it natively and the model is big enough to gain
        self.dtype = rollout_dtype(cfg, self.device, params=sum(t.numel() for t in self.model.parameters()))
        self.model.to(DTYPES[self.dtype])
        self.model.requires_grad_(False)
        self.model.eval()
        # on a CPU: the linears' decode-sized form, and a decode step without transformers' per-call machinery
        # (Llama-style models, decode_step.py; others, and any model on an accelerator: the model's own forward)
        self.decode_step = model_step(self.model)
        if self.device.type == "cpu":
            use_skinny_linears(self.model)
            self.decode_step = decode_step_for(self.model)
        self.eos, self.pad = eos_token_id, pad_token_id
        self.weight_version = 0

    @torch.no_grad()
    def generate(self, batch: Batch, params: RolloutConfig | None = None) -> Batch:
        """Sample one response per row (rows are already repeated n times per prompt)."""
        self._mark(batch)
        p = params or self.cfg.rollout
        gen = sampling_generator(batch, self.device)  # run.deterministic: seeded per draw (determinism.py)
        parts = [self._generate(mb, p, gen) for mb in batch.split(p.micro_batch_size)]
        width = max(x["response_ids_BR"].shape[1] for x in parts)
        for x in parts:  # micro-batches may stop at different lengths: pad to one width
            pad = width - x["response_ids_BR"].shape[1]
            if pad:
                x["response_ids_BR"] = torch.nn.functional.pad(x["response_ids_BR"], (0, pad), value=self.pad)
                x["response_mask_BR"] = torch.nn.functional.pad(x["response_mask_BR"], (0, pad), value=0)
                x["rollout_logprobs_BR"] = torch.nn.functional.pad(x["rollout_logprobs_BR"], (0, pad), value=0.0)
        return Batch.cat(parts)

    def _generate(self, batch: Batch, p: RolloutConfig, gen: torch.Generator | None = None) -> Batch:
        """Prefill (once per distinct prompt), then one token per step with the KV cache. A row leaves the
        batch (and its cache rows go) as soon as it samples EOS, so a step costs what the rows still
        generating cost: HF `generate` keeps decoding finished rows until the longest one stops (68% of its
        decode slots at 64 tokens in benchmarks/rollout_throughput.py) and pays a set-up cost per call that
        dominates small models."""
        ids = batch["prompt_ids_BP"].to(self.device)
        attn = batch["prompt_mask_BP"].to(self.device)
        B, R = ids.shape[0], p.max_new_tokens
        tokens = torch.full((B, R), self.pad, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((B, R), dtype=torch.float32, device=self.device)
        lengths = torch.full((B,), R, dtype=torch.long, device=self.device)
        rows = torch.arange(B, device=self.device)       # batch row of each still-generating sequence
        next_pos = attn.sum(-1, keepdim=True)            # position id of the next token, per row
        # the n samples of a prompt share its prefill: run it once per distinct prompt, then repeat the cache
        distinct, copy_of = torch.unique(torch.cat([ids, attn], dim=1), dim=0, return_inverse=True)
        first_ids, first_attn = distinct[:, :ids.shape[1]], distinct[:, ids.shape[1]:]
        cache = reserved_cache(self.model.config, ids.shape[1] + R)
        logits = self.model(input_ids=first_ids, attention_mask=first_attn,
                            position_ids=(first_attn.cumsum(-1) - 1).clamp(min=0),
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1][copy_of]
        cache.batch_select_indices(copy_of)
        steps = R
        for t in range(R):
            tok, logp = sample_next(logits.float(), p, gen)
            tokens[rows, t] = tok
            logprobs[rows, t] = logp
            done = tok == self.eos
            if t == R - 1:
                break
            if done.any():
                lengths[rows[done]] = t + 1
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    steps = t + 1
                    break
                rows, tok, next_pos, attn = rows[keep], tok[keep], next_pos[keep], attn[keep]
                cache.batch_select_indices(keep)
            attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)
            logits = self.decode_step(tok, next_pos, attn, cache)
            next_pos = next_pos + 1
        resp_mask = (torch.arange(steps, device=self.device)[None, :] < lengths[:, None]).long()
        return Batch({"response_ids_BR": tokens[:, :steps].cpu(), "response_mask_BR": resp_mask.cpu(),
                      "rollout_logprobs_BR": logprobs[:, :steps].cpu()})

    @torch.no_grad()
    def generate_episodes(self, rows: Batch | list[dict], env_cls, params: RolloutConfig | None = None) -> Batch:
        """One multi-turn episode per row (rows already repeated n times per prompt; a Batch's non-tensor fields
        are the rows), each with a fresh `env_cls()`: model and environment take turns, token in, token out
        (episodes.py), one KV cache per micro-batch as `generate`."""
        from .episodes import cat_episodes, run_episodes
        self._mark(rows)
        tokenizer, prompt_ids, rows, envs = self._episodes_setup(rows, env_cls)
        p = params or self.cfg.rollout
        parts = []
        for start in range(0, len(rows), p.micro_batch_size):
            end = start + p.micro_batch_size
            parts.append(run_episodes(self.model, tokenizer, envs[start:end], rows[start:end], p, sample_next,
                                      self._env_pool, self.cfg.env.step_timeout_s, prompt_ids=prompt_ids,
                                      eos=self.eos, pad=self.pad, decode_step=self.decode_step))
        return cat_episodes(parts, self.pad)

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
        # read back from the live model, not from the copy targets: a load into anything else is caught
        out = {"bytes": sum(v.numel() * v.element_size() for v in state.values()),
               **self._verify(state, self.model.state_dict())}
        if out["mismatch"] is None:  # the version names weights this engine is known to hold
            self.weight_version = version
        return out

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights, on the CPU (to compare with the policy's)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def sleep(self) -> None:
        """Colocated mode: give the accelerator back to the trainers during the update (weights to host
        memory). A no-op on CPU."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        self.model.to(self.device)

