"""A sample request's rows in, its sequences out: prompts left-padded into one engine batch (the engines' layout),
each sequence cut after its first stop, and what a client sampled as a Batch the inspector shows.

    batch, params = prompt_batch(prompts, counts, request_params, cfg.rollout, tokenizer)
    tokens, logprobs, stopped = cut(tokenizer, ids_R, mask_R, logprobs_R, stop)
"""
from __future__ import annotations

import torch

from ..data.batch import Batch


class SampleParamsError(ValueError):
    """Sampling settings out of what the engines serve: the message names the setting and the range."""


def prompt_batch(prompts: list[list[int]], counts: list[int], params: dict, rollout, tokenizer):
    """Each prompt `counts[i]` times, left-padded, and the request's settings over `rollout` (RolloutConfig)."""
    max_tokens = params.get("max_tokens") or rollout.max_new_tokens
    if not 1 <= max_tokens <= 1 << 16:
        raise SampleParamsError(f"max_tokens={max_tokens}: ask for 1 to 65536")
    top_k = params.get("top_k", -1)
    rollout_params = rollout.model_copy(update={"n": 1, "temperature": float(params.get("temperature", 1.0)),
                                                "top_p": float(params.get("top_p", 1.0)),
                                                "top_k": 0 if top_k is None or top_k < 0 else int(top_k),
                                                "max_new_tokens": int(max_tokens)})
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id or 0
    rows = [p for p, n in zip(prompts, counts) for _ in range(n)]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], dtype=torch.long)
    batch = Batch({"prompt_ids_BP": ids, "prompt_mask_BP": mask})
    if params.get("seed") is not None:  # each engine rank seeds its generator from its first row's seed
        batch["sample_seed_B"] = int(params["seed"]) + torch.arange(len(rows), dtype=torch.long)
    return batch, rollout_params


def cut(tokenizer, ids: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor, stop) -> tuple:
    """One sequence's tokens up to and including its first stop (token ids, or strings found in the decoded
    text), its log-probs, and whether it stopped (a stop or EOS) rather than ran out of max_tokens."""
    n = int(mask.sum())
    tokens, lps = ids[:n].tolist(), logprobs[:n].tolist()
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    ids_stop = {s for s in stops if isinstance(s, int)}
    end = next((j + 1 for j, t in enumerate(tokens) if t in ids_stop), n)
    texts = [s for s in stops if isinstance(s, str)]
    decode = tokenizer.decode
    if texts and any(t in decode(tokens[:end]) for t in texts):  # only then look for where it completes
        end = next(j + 1 for j in range(end) if any(t in decode(tokens[:j + 1]) for t in texts))
    if end < n or (ids_stop and tokens[end - 1] in ids_stop):
        return tokens[:end], lps[:end], True
    return tokens, lps, bool(tokens) and tokens[-1] == tokenizer.eos_token_id

def sampled_batch(tokenizer, prompt: list[int], sequences: list[tuple]) -> Batch:
    """What a client sampled as a Batch the inspector shows (sess.inspect(srv.samples[-1]))."""
    width = max(len(t) for t, _, _ in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask, lps = torch.zeros_like(ids), torch.zeros(len(sequences), width)
    for i, (t, lp, _) in enumerate(sequences):
        ids[i, :len(t)], mask[i, :len(t)], lps[i, :len(t)] = torch.tensor(t), 1, torch.tensor(lp)
    tok, n = tokenizer, len(sequences)
    prompt_ids = torch.tensor(prompt, dtype=torch.long).repeat(n, 1)
    return Batch({"prompt_ids_BP": prompt_ids, "prompt_mask_BP": torch.ones_like(prompt_ids),
                  "response_ids_BR": ids, "response_mask_BR": mask, "rollout_logprobs_BR": lps},
                 {"prompt": [tok.decode(prompt)] * n, "response": [tok.decode(t) for t, _, _ in sequences]})
