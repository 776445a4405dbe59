"""The rollout engine's reserved KV cache (roles/rollout/kv_cache.py) against transformers' own DynamicCache: the
same model decoding the same tokens through either must give the same logits, through everything the engine
does to a cache (a left-padded prefill of distinct prompts, repeating their rows for the n samples, dropping
finished rows mid-decode) and what transformers may do (growing past the reserved room, cropping, resetting).

Tolerance: both caches feed the attention the same numbers, but a view into a reserved buffer has another row
stride than a concatenated tensor, and a CPU's matmul may block it differently (the last bits of fp32 sums move
with the order of addition). 1e-5 absolute on logits of order 1 holds that and fails any misplaced position,
which moves a logit by ~1e-2 or more here."""
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlbench_nb.roles.rollout.kv_cache import ReservedLayer, reserved_cache

TOL = 1e-5


def _model(kind: str):
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    model = (Qwen2ForCausalLM(Qwen2Config(**shape)) if kind == "qwen2"
             else LlamaForCausalLM(LlamaConfig(**shape)))
    return model.eval()


def _decode(model, cache, prompts, mask, steps: int, drop_at: int, keep: torch.Tensor):
    """The engine's walk: prefill distinct prompts, repeat each twice, then `steps` tokens (greedy), dropping
    rows to `keep` before step `drop_at`. The logits of every step."""
    out = []
    with torch.no_grad():
        logits = model(input_ids=prompts, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       past_key_values=cache, use_cache=True).logits[:, -1]
        repeat = torch.arange(prompts.shape[0]).repeat_interleave(2)
        logits, mask = logits[repeat], mask[repeat]
        cache.batch_select_indices(repeat)
        for step in range(steps):
            out.append(logits)
            if step == drop_at:
                logits, mask = logits[keep], mask[keep]
                cache.batch_select_indices(keep)
            token = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = model(input_ids=token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                           past_key_values=cache, use_cache=True).logits[:, -1]
    return out + [logits]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("capacity", [40, 7])  # room for the whole walk; too little, so it must grow mid-decode
def test_reserved_cache_decodes_as_dynamic_cache(kind, capacity):
    model = _model(kind)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 64, (3, 6), generator=g)
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0  # left padding, as the engine's batches
    mask[2, :4] = 0
    keep = torch.tensor([0, 2, 3, 5])
    theirs = _decode(model, DynamicCache(config=model.config), prompts, mask, 12, 4, keep)
    cache = reserved_cache(model.config, capacity)
    assert all(isinstance(layer, ReservedLayer) for layer in cache.layers)
    ours = _decode(model, cache, prompts, mask, 12, 4, keep)
    assert len(ours) == len(theirs) == 13
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=TOL, rtol=0), (step, (a - b).abs().max())
    assert cache.get_seq_length() == 6 + 12
    # the reserve was made once, or grown by doubling (7 -> 16 at position 8 -> 34 at 17), never per step
    assert cache.layers[0]._keys.shape[-2] == (40 if capacity == 40 else 34)


def test_crop_reset_and_repeat_keep_the_layer_consistent():
    layer = ReservedLayer(capacity=8)
    k = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).reshape(2, 1, 5, 2)
    keys, values = layer.update(k, -k)
    assert torch.equal(keys, k) and torch.equal(values, -k) and layer.get_seq_length() == 5
    layer.crop(-2)  # transformers' form: remove two positions
    assert layer.get_seq_length() == 3 and torch.equal(layer.keys, k[..., :3, :])
    layer.crop(10)  # the legacy form: keep at most 10 (no change), then keep 2
    assert layer.get_seq_length() == 3
    layer.crop(2)
    assert torch.equal(layer.keys, k[..., :2, :])
    step = torch.full((2, 1, 1, 2), 7.0)
    keys, _ = layer.update(step, step)  # writes after the cropped end, not after the old one
    assert torch.equal(keys, torch.cat([k[..., :2, :], step], dim=-2))
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.keys, torch.cat([k[..., :2, :], step], dim=-2).repeat_interleave(2, dim=0))
    layer.reset()
    assert layer.get_seq_length() == 0 and not layer.is_initialized
    keys, _ = layer.update(step, step)
    assert torch.equal(keys, step)
