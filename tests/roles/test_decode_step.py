"""The HF engine's written-out decode step (roles/rollout/decode_step.py) against the model's own forward: the
same logits at every step of the engine's walk (left-padded prefill, the n samples' rows repeated, finished rows
dropped, the cache grown past its room) on each covered architecture and option that changes the math (grouped
or not, biases, a head size of its own, a scaled rotary), in fp32 and bf16; and the model's forward kept where
the step is not covered or does not agree; past the attention's small size, SDPA in both.

Tolerance: the two run the same ops on the same numbers, and here agree to the last bit in fp32 and bf16; but
the model's linears see [rows, 1, features] and the step's [rows, features], and another CPU's BLAS may block
the two differently (the last bits of sums move with the order of addition). 1e-5 absolute on logits of order
5 holds that in fp32 and fails a wrong rotary, bias, mask or cache position, each of which moves a logit by 0.1
or more; in bf16 a last bit can round a hidden value one bf16 step (2^-8) the other way: 5e-2."""
import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rlbench_nb.ops import attention
from rlbench_nb.roles.rollout import decode_step, skinny_linear
from rlbench_nb.roles.rollout.decode_step import DecodeStep, _rotate, _signed_sin, decode_step_for, model_step
from rlbench_nb.roles.rollout.kv_cache import reserved_cache
from rlbench_nb.roles.rollout.skinny_linear import use_skinny_linears

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)  # logits of order 1
MODELS = {
    "llama-gqa": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "llama-mha-biases-head48": lambda: LlamaForCausalLM(LlamaConfig(**{
        **SHAPE, "num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True, "head_dim": 48})),
    "llama3-rope": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),
    "mistral-no-window": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None)),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def _model(kind: str, dtype=torch.float32, skinny: bool = True):
    """A random-init model as the engine holds one on a CPU: ops/attention.py's attention, skinny linears (every
    fp32 one, whatever its size: these shapes are below the engine's MIN_WEIGHT, and the step has a path of its
    own for them; bf16 linears keep F.linear, as in the engine)."""
    torch.manual_seed(0)
    model = MODELS[kind]().eval().to(dtype)
    attention.register()
    model.set_attn_implementation(attention.NAME)
    with torch.no_grad():  # biases are zeros at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    if skinny:
        use_skinny_linears(model, min_weight=0)
    return model.requires_grad_(False)


def _walk(model, step, prompts, mask, tokens, drop_at: int, keep: torch.Tensor, capacity: int):
    """The engine's decode walk (hf_engine.py) feeding `tokens` [steps, rows] (the same to both ways: a sampled
    token that one bf16 last bit flipped would make the rest of two walks incomparable), each decode step by
    `step` (a DecodeStep, or model_step: the model's own forward): the logits of every step."""
    cache = reserved_cache(model.config, capacity)
    with torch.no_grad():
        logits = model(input_ids=prompts, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        repeat = torch.arange(prompts.shape[0]).repeat_interleave(2)
        logits, mask = logits[repeat], mask[repeat]
        cache.batch_select_indices(repeat)
        out = []
        rows = torch.arange(len(repeat))
        for t in range(len(tokens)):
            out.append(logits.float())
            if t == drop_at:
                logits, mask, rows = logits[keep], mask[keep], rows[keep]
                cache.batch_select_indices(keep)
            token = tokens[t, rows]
            positions = mask.sum(-1, keepdim=True)
            mask = torch.cat([mask, mask.new_ones(len(token), 1)], dim=1)
            logits = step(token, positions, mask, cache)
    return out + [logits.float()]


def _both_walks(model, step=None):
    step = step or DecodeStep.for_model(model)
    assert step is not None
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 96, (3, 6), generator=g)
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0  # left padding, as the engine's batches
    mask[2, :4] = 0
    keep = torch.tensor([0, 2, 3, 5])
    tokens = torch.randint(1, 96, (12, 6), generator=g)
    # room for 10 positions: the cache grows mid-decode
    theirs = _walk(model, model_step(model), prompts, mask, tokens, 4, keep, capacity=10)
    ours = _walk(model, step, prompts, mask, tokens, 4, keep, capacity=10)
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(MODELS))
def test_the_step_gives_the_models_logits_through_the_engines_walk(kind, dtype):
    ours, theirs = _both_walks(_model(kind, dtype))
    for t, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=TOL[dtype], rtol=0), (t, (a - b).abs().max())
    # not vacuous: the steps' logits move with their tokens and positions by far more than the tolerance
    assert (theirs[1] - theirs[2]).abs().max() > 0.5


def test_a_layer_with_a_linear_of_its_own_kind_runs_each_linears_own_forward():
    """A layer whose linears are not all the skinny kind (here layer 0's v projection keeps F.linear, as a small
    one would at the engine's MIN_WEIGHT) runs every linear through its module; the other layer through the
    step's W @ h^T. Both give the model's logits."""
    model = _model("llama-gqa")
    v = model.model.layers[0].self_attn.v_proj
    v.forward = torch.nn.Linear.forward.__get__(v)
    assert [layer.skinny for layer in DecodeStep(model).layers] == [False, True]
    ours, theirs = _both_walks(model)
    for t, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.allclose(a, b, atol=TOL[torch.float32], rtol=0), (t, (a - b).abs().max())


@pytest.mark.parametrize("max_rows", [skinny_linear.MAX_ROWS, 4])
def test_one_operand_per_input_of_a_layer_and_only_where_the_skinny_form_takes_the_rows(max_rows, monkeypatch):
    """The W @ x^T operand is made four times a layer (q/k/v's, o's, gate/up's, down's), not once per linear (seven);
    past MAX_ROWS (here 4: the walk's 6-row steps) the linears run their own forward (F.linear), as
    skinny_forward would. The model's logits either way."""
    model = _model("llama-gqa")
    step = DecodeStep.for_model(model)
    made = []
    monkeypatch.setattr(decode_step, "columns", lambda x: made.append(x.shape[0]) or skinny_linear.columns(x))
    monkeypatch.setattr(skinny_linear, "MAX_ROWS", max_rows)
    ours, theirs = _both_walks(model, step)
    for t, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.allclose(a, b, atol=TOL[torch.float32], rtol=0), (t, (a - b).abs().max())
    # the walk: 12 steps, 4 of 6 rows, then 8 of 4 rows; 2 layers, 4 operands each
    six_row_steps = 4 if max_rows >= 6 else 0
    assert made == [6] * 4 * 2 * six_row_steps + [4] * 4 * 2 * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 48, 64])
def test_the_rotation_is_transformers_to_the_bit(head_dim, dtype):
    """x * cos + x.roll(half) * signed_sin against apply_rotary_pos_emb's x * cos + rotate_half(x) * sin: the same
    products (a sign moved from one factor to the other is exact), the same sums, so equal, not close."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(5, n, 1, head_dim, generator=g).to(dtype) for n in (4, 2))
    cos, sin = (torch.randn(5, 1, head_dim, generator=g).to(dtype) for _ in range(2))
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(_rotate(q, cos[:, None], _signed_sin(sin[:, None])), q_ref)
    assert torch.equal(_rotate(k, cos[:, None], _signed_sin(sin[:, None])), k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_past_the_small_attentions_size_the_step_takes_sdpa_as_the_model_does(dtype, monkeypatch):
    """A big decode batch (rows x heads x keys over SMALL_SCORES) runs SDPA in the model's attention: in bf16 its
    scores differ from the plain path's by more than the tolerance, so a step that kept the plain path fails."""
    monkeypatch.setattr(attention, "SMALL_SCORES", 0)  # every call past it
    ours, theirs = _both_walks(_model("qwen2", dtype))
    for t, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.allclose(a, b, atol=TOL[dtype], rtol=0), (t, (a - b).abs().max())


def test_not_covered_or_not_agreeing_keeps_the_models_forward():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)).eval()
    assert DecodeStep.for_model(gpt2) is None  # another architecture
    assert not isinstance(decode_step_for(gpt2), DecodeStep)  # the engine decodes it through model_step
    sliding = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert DecodeStep.for_model(sliding.eval()) is None  # a sliding window changes which keys a step sees
    assert DecodeStep.for_model(MistralForCausalLM(MistralConfig(**SHAPE)).eval()) is None  # its 4096 window
    sdpa = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    assert sdpa.config._attn_implementation == "sdpa"
    assert DecodeStep.for_model(sdpa) is None  # model.attention=sdpa (not the CPU default): the model's own
    # a covered class of another structure (here: no rotary module) is not built, and is no error either
    odd = _model("llama-gqa")
    del odd.model.rotary_emb
    assert DecodeStep.for_model(odd) is None
    # a change the step does not know of (here, a layer's MLP doing something else): the check at build time
    # sees the two disagree, and the engine keeps the model's forward
    model = _model("llama-gqa")
    assert DecodeStep.for_model(model) is not None
    mlp = model.model.layers[1].mlp
    plain = mlp.forward
    mlp.forward = lambda x: 2 * plain(x)
    assert DecodeStep.for_model(model) is None
