"""Helpers every role shares: device choice, model loading, token log-probs, memory, RNG state."""
from __future__ import annotations

import random

import torch

from ..ops.attention import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


_PREFERRED = ("auto", "default")  # (device, pool) of this process's workers: cluster.pools.<pool>.device


def prefer_device(device: str, pool: str) -> None:
    """What `pick_device` gives in this process (a Ray actor sets it from its pool before any worker starts)."""
    global _PREFERRED
    _PREFERRED = (device, pool)


def pick_device() -> torch.device:
    """CUDA when present, else CPU, unless the worker's pool says which; no code path assumes either."""
    device, pool = _PREFERRED
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"pool '{pool}' asks for device 'cuda' but this process sees no GPU "
                           "(CUDA_VISIBLE_DEVICES is empty, or torch is a CPU build): check the node's GPUs and "
                           f"cluster.pools.{pool}.gpus_per_worker, or set its device to cpu / auto")
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_causal_lm(path: str, dtype: str, device: torch.device, attention: str):
    from transformers import AutoModelForCausalLM
    model = load_model(AutoModelForCausalLM, path, attention, device, dtype=DTYPES[dtype])
    return model.to(device)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every dropout of a trained model at 0 (TRL's disable_dropout): a trainer stays in training mode, where dropout
    would make prepare's no-grad log-probs and values noise, and the update's ratio against them other than 1 on
    the same weights. The dropout modules (GPT-2, OPT) and the probabilities attention layers keep as numbers
    (Llama's attention_dropout); LoRA's own dropout is added after, as model.lora.dropout says."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def make_adamw(params, lr: float, betas, weight_decay: float, sharded: bool) -> torch.optim.AdamW:
    """AdamW; the fused kernel (one pass over all tensors, the same math) for plain tensors, as TRL and HF
    Trainer use by default. FSDP2's DTensor shards keep torch's default implementation."""
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=None if sharded else True)


TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
                   "chat_template.*")


def copy_tokenizer_files(src, dst) -> None:
    """The tokenizer's files of model folder `src` into `dst`, so that `dst` loads with AutoTokenizer too."""
    import shutil
    from pathlib import Path
    for pattern in TOKENIZER_FILES:
        for f in Path(src).glob(pattern):
            if f.is_file():
                shutil.copy2(f, Path(dst) / f.name)


def read_safetensors(path, device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path), device=str(device))


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model` in place. Keys may be missing only for weights tied to a loaded one
    (HF drops `lm_head.weight` when it is the embedding); anything else is an error."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded_ptrs = {p.data_ptr() for k, p in model.state_dict().items() if k in state}
    really_missing = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded_ptrs]
    if unexpected or really_missing:
        raise ValueError(f"weights do not fit the model: missing {really_missing[:5]}, unexpected {unexpected[:5]}")


def full_sequences(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt + right-padded response -> (input_ids, attention_mask, position_ids), each [B, P+R]."""
    return join_sequences(batch["prompt_ids_BP"], batch["prompt_mask_BP"], batch["response_ids_BR"],
                          batch["response_mask_BR"])


def join_sequences(prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR):
    """`full_sequences` on the tensors themselves."""
    ids = torch.cat([prompt_ids_BP, response_ids_BR], dim=1)
    mask = torch.cat([prompt_mask_BP, response_mask_BR], dim=1)
    return ids, mask, (mask.long().cumsum(-1) - 1).clamp(min=0)


def response_hidden_slice(batch) -> slice:
    """Positions whose outputs predict the response tokens: P-1 .. P+R-2."""
    P, R = batch["prompt_ids_BP"].shape[1], batch["response_ids_BR"].shape[1]
    return slice(P - 1, P + R - 1)


def token_logprobs(logits_BRV: torch.Tensor, ids_BR: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[id] per position, in fp32."""
    logits = logits_BRV.float()
    return logits.gather(-1, ids_BR.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
