"""LoRA adapters on the policy's model (`model.lora.r > 0`, through peft): what trains, what the rollout
engine receives, what a checkpoint holds.

    model = add_adapters(model, cfg.model.lora)   # a peft model: only lora_A / lora_B require grad
    merged_state(full_state, scaling)             # base-model names, W + scaling * B @ A: what engines load
    adapter_state(full_state)                     # peft's file names: adapter_model.safetensors

Names under peft (its `get_peft_model` wraps the model): an adapted linear's frozen weight is
`base_model.model.<name>.base_layer.weight`, its adapter `<name>.lora_A.default.weight` [r, in] and
`<name>.lora_B.default.weight` [out, r]; every other weight `base_model.model.<name>`. Merging here, from the
gathered full state, works the same with and without FSDP2 (peft's own merge_adapter edits the model in
place, which a sharded model cannot do per rank).
"""
from __future__ import annotations

import torch

PREFIX = "base_model.model."
ADAPTER = "default"  # peft's adapter name; its saved files leave it out


def add_adapters(model: torch.nn.Module, lora, seed: int = 0) -> torch.nn.Module:
    """`model` wrapped by peft with fresh adapters (B = 0: the adapted model starts equal to the base).
    A's random init is drawn from `seed` in a forked RNG: every FSDP2 rank must start from the same values
    (each shards its own copy), and the process's own RNG (the local backend's sampling) is left untouched."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                        lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return get_peft_model(model, config)
    except ValueError as e:  # target modules not found in the model
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"model.lora.target_modules={lora.target_modules!r} does not fit this model ({e}); "
                         f"its linear layers are {names}, or use 'all-linear'") from None


def scaling(lora) -> float:
    return lora.alpha / lora.r


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The full state of a peft model as the base model's weights with each adapter merged in (computed in
    fp32, returned in each weight's dtype): what a rollout engine without adapters loads."""
    out = {}
    for k, v in state.items():
        if is_adapter(k):
            continue
        if k.endswith(".base_layer.weight"):
            stem = k.removesuffix(".base_layer.weight")
            a, b = state[f"{stem}.lora_A.{ADAPTER}.weight"], state[f"{stem}.lora_B.{ADAPTER}.weight"]
            v = (v.float() + scale * (b.float() @ a.float())).to(v.dtype)
        out[k.removeprefix(PREFIX).replace(".base_layer.", ".")] = v
    return out


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters alone, under the names peft saves them with (`PeftModel.from_pretrained` reads them)."""
    return {k.replace(f".{ADAPTER}.", "."): v.contiguous() for k, v in state.items() if is_adapter(k)}


def adapter_to_model_names(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`adapter_state`'s names back to the live model's (the adapter name put back)."""
    return {k.replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(".lora_B.", f".lora_B.{ADAPTER}."): v
            for k, v in adapter.items()}


def base_fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """A digest of the frozen base weights (rollout/base.py's fingerprints): an adapter saved on one base
    and loaded onto another is refused instead of silently producing a different model."""
    from .rollout.base import fingerprints
    return fingerprints([v for k, v in sorted(model.state_dict().items()) if not is_adapter(k)])


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
