"""One decode step of a Llama-style model, written out: the HF engine's decode loop without transformers'
per-call machinery.

    step = decode_step_for(model)             # a DecodeStep, or model_step(model) where this does not cover it
    logits = step(tokens, positions, attention_mask, cache)   # [rows] -> [rows, vocab], as model(...) gives

A decode step multiplies a few rows by every weight of the model; on a CPU the matmuls are all the work there is
to do, and the rest is overhead. Through `model(...)` a step of SmolLM2-135M at 16 rows spent ~40% outside the
matmuls on a 2-core EPYC (AVX2): per call a mask built from the 2-D attention mask, per layer module calls,
keyword plumbing, the attention interface's dispatch, a rotary and a norm of a few small ops each. Here the same
ops run in the same order on the same modules' weights — the logits are those of `model(...)` to the last bit on
the models of tests/roles/test_decode_step.py — with one mask, one rotary (its sin signed once, so a rotation is
x * cos + x.roll(half) * sin: four ops, not seven) per step for all layers, each layer's modules looked up once,
and the skinny linears' operand (skinny_linear.py: rows padded to a multiple of 16, transposed) made once per
input, not once per linear: q, k and v share theirs, as do gate and up. With the attention's mask applied in
place, session 43's changes took a fixed 16-row SmolLM2 step 7% faster again, to the same bits.

Covered: Llama, Mistral without a sliding window, Qwen2 without sliding layers (the same decoder layer: RMSNorm,
rotary, grouped-query attention, a gated MLP; biases as the modules hold them), with the attention the engine's
model gets on a CPU (ops/attention.py's function, which the step calls itself: its plain matmuls for small calls
and SDPA for big ones, as in the model). Anything else — another architecture, a sliding window, another
attention implementation, a cache layer that is not `ReservedLayer` — keeps the model's forward.
`for_model` also runs one step both ways on a tiny input and keeps the model's forward if they differ: a config
option this does not know of must cost speed, never the sampled distribution.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ...ops.attention import NAME as CPU_ATTENTION
from ...ops.attention import small_or_sdpa_attention
from .kv_cache import ReservedLayer, reserved_cache
from .skinny_linear import columns, is_skinny, takes_columns, times_columns

COVERED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# one step against model(...) on a tiny input, as a share of the logits' scale (1 + max |logit|): the same ops on
# the same numbers agree to the last bits a matmul's blocking moves; a wrong rotary, bias or mask moves them by >1%
AGREE_FP32, AGREE_LOW = 1e-4, 2e-2


def model_step(model: torch.nn.Module):
    """The model's own forward as a decode step: the fallback, and what a DecodeStep is checked against."""
    def step(tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        return model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=positions,
                     past_key_values=cache, use_cache=True).logits[:, -1]
    return step


def decode_step_for(model: torch.nn.Module):
    """The written-out step where it covers `model` and agrees with it, else the model's own forward."""
    return DecodeStep.for_model(model) or model_step(model)


class DecodeStep:
    def __init__(self, model: torch.nn.Module):
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.lm_head = model.lm_head
        self.layers = [Layer.of(layer) for layer in inner.layers]
        attn = self.layers[0].attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> DecodeStep | None:
        """The written-out step for `model`, or None where it is not covered or does not agree with the model."""
        c = model.config
        if type(model).__name__ not in COVERED or getattr(c, "sliding_window", None) is not None \
                or any(t != "full_attention" for t in getattr(c, "layer_types", None) or ()):
            return None
        # the step calls ops/attention.py's function, what the engine's model runs on a CPU by default
        # (model.attention=auto); a model asked to run another keeps its forward
        if getattr(c, "_attn_implementation", None) != CPU_ATTENTION:
            return None
        try:
            step = cls(model)
            return step if step.agrees_with(model) else None
        except Exception:  # a covered class of another structure (remote code, an older layout): its own forward
            return None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                 cache) -> torch.Tensor:
        """Logits [rows, vocab] of the next token after `tokens` [rows] at `positions` [rows, 1], each row seeing
        its keys where `attention_mask` [rows, keys so far + 1] is 1; the step's keys and values go into `cache`
        (a `reserved_cache`, as `model(..., past_key_values=cache)` would write them)."""
        rows = tokens.shape[0]
        x = self.embed(tokens)  # through the module: its hooks see the step as they see model(...)'s
        cos, sin = self.rotary(x, positions)  # [rows, 1, head dim]: the model's own (its scaling, dynamic or not)
        cos, sin = cos[:, None], _signed_sin(sin[:, None])  # [rows, 1 (heads), 1, head dim], for every layer
        # the mask transformers' sdpa_mask makes for one query, once for every layer: None where no key is padding
        mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        # the skinny linears' W @ x^T (skinny_linear.py) from one padded, transposed operand per input, not one per
        # linear: q, k and v share theirs, as do gate and up
        skinny_now = takes_columns(rows)
        for i, layer in enumerate(self.layers):
            own = not (skinny_now and layer.skinny)  # this layer's linears through their modules' forward
            h = _input(_rms_norm(layer.input_norm, x), own)
            q = _rotate(_project(layer.q, h, own, rows).view(rows, -1, 1, self.head_dim), cos, sin)
            k = _rotate(_project(layer.k, h, own, rows).view(rows, -1, 1, self.head_dim), cos, sin)
            v = _project(layer.v, h, own, rows).view(rows, -1, 1, self.head_dim)
            keys, values = cache.layers[i].update(k, v)
            # the model's own attention function (plain matmuls, or SDPA past SMALL_SCORES), called as it calls it
            out, _ = small_or_sdpa_attention(layer.attn, q, keys, values, mask, scaling=self.scaling, dropout=0.0)
            x = x + _project(layer.o, _input(out.reshape(rows, -1), own), own, rows)
            h = _input(_rms_norm(layer.post_norm, x), own)
            up = layer.act(_project(layer.gate, h, own, rows)) * _project(layer.up, h, own, rows)
            x = x + _project(layer.down, _input(up, own), own, rows)
        return self.lm_head.forward(_rms_norm(self.norm, x))

    def agrees_with(self, model: torch.nn.Module) -> bool:
        """One step on a tiny left-padded batch, this way and model(...)'s, from the same prefill."""
        param = next(model.parameters())
        ids = torch.tensor([[0, 1, 2], [3, 4, 5]], device=param.device) % model.config.vocab_size
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]], device=param.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = []
        with torch.no_grad():
            for decode in (self, model_step(model)):
                cache = reserved_cache(model.config, 4)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                               use_cache=True, logits_to_keep=1).logits[:, -1]
                if not all(isinstance(layer, ReservedLayer) for layer in cache.layers):
                    return False
                token, step_mask = logits.argmax(-1), torch.cat([mask, mask.new_ones(2, 1)], dim=1)
                next_pos = mask.sum(-1, keepdim=True)
                out.append(decode(token, next_pos, step_mask, cache).float())
        tol = AGREE_FP32 if param.dtype == torch.float32 else AGREE_LOW
        return bool((out[0] - out[1]).abs().max() <= tol * (1 + out[1].abs().max()))


class Layer(NamedTuple):
    """A decoder layer's modules, looked up once (not through nn.Module's __getattr__ every step), and whether all
    its linears have the skinny form (the engine gives it to every plain fp32 linear big enough to gain). Modules,
    not tensors: a step reads each weight as it is then (set_weights copies into them in place)."""
    attn: torch.nn.Module
    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    o: torch.nn.Module
    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module
    act: torch.nn.Module
    skinny: bool

    @classmethod
    def of(cls, layer: torch.nn.Module) -> Layer:
        a, mlp = layer.self_attn, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        return cls(a, layer.input_layernorm, layer.post_attention_layernorm, *linears, mlp.act_fn,
                   all(is_skinny(lin) for lin in linears))


def _input(x: torch.Tensor, own: bool) -> torch.Tensor:
    """What a layer's linears take: x itself for their own forward, else its W @ x^T operand."""
    return x if own else columns(x)


def _project(linear: torch.nn.Module, x: torch.Tensor, own: bool, rows: int) -> torch.Tensor:
    """linear(x), from `_input(x, own)`: the module's forward, or skinny_forward's W @ x^T on the shared operand."""
    return linear.forward(x) if own else times_columns(linear, x, rows)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm's forward (Qwen2's and Mistral's are the same): in fp32, the weight applied in x's dtype."""
    if x.dtype == torch.float32:  # its two .to() calls return x itself: ~5 us each a call all the same here
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with rotate_half's sign on its first half: rotate_half(x) * sin == x.roll(half) * _signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor, x * cos + rotate_half(x) * sin, in half the ops:
    rotate_half(x) = cat(-x2, x1) is x.roll(half) = cat(x2, x1) with the sign moved to sin (once a step). The
    products are the same numbers: -(a * b) == (-a) * b in IEEE arithmetic."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
