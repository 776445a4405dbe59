"""rollout.dtype resolved on a machine: `auto` takes bf16 only where it pays (ops/precision.py)."""
from __future__ import annotations

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb.ops import precision
from rlbench_nb.roles.rollout.base import first_difference

BIG, SMALL = 135_000_000, 700_000


@pytest.mark.parametrize("rollout, model, device, params, native, want", [
    ("auto", "float32", "cpu", BIG, True, "bfloat16"),     # the case it is for
    ("auto", "float32", "cpu", SMALL, True, "float32"),    # weights in cache: bf16's casts cost more (0.7-1.0x)
    ("auto", "float32", "cpu", None, True, "float32"),     # an engine that does not say its size (vLLM)
    ("auto", "float32", "cpu", BIG, False, "float32"),     # AVX2: bf16 emulated, half fp32's speed
    ("auto", "float32", "cuda", BIG, True, "float32"),     # a GPU: model.dtype says
    ("auto", "bfloat16", "cpu", SMALL, False, "bfloat16"),
    ("model", "float32", "cpu", BIG, True, "float32"),
    ("bfloat16", "float32", "cpu", SMALL, False, "bfloat16"),  # asked for: given, even where slow
    ("float32", "bfloat16", "cuda", BIG, True, "float32"),
])
def test_rollout_dtype_resolves_auto_by_device_size_and_cpu(monkeypatch, rollout, model, device, params, native, want):
    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    cfg = rl.Config.load(None, [f"rollout.dtype={rollout}", f"model.dtype={model}"])
    assert precision.rollout_dtype(cfg, device, params) == want


def test_a_typo_in_rollout_dtype_names_the_choices():
    with pytest.raises(rl.ConfigError, match="rollout.dtype") as e:
        rl.Config.load(None, ["rollout.dtype=bf16"])
    assert "bfloat16" in str(e.value)


def test_the_push_check_compares_fp32_sent_with_bf16_held():
    """An fp32 tensor copied into a bf16 engine matches what was sent read in bf16; a stale tensor does not."""
    torch.manual_seed(0)
    sent = {"w": torch.randn(1000, 300), "b": torch.randn(300)}
    held = {k: torch.empty_like(v, dtype=torch.bfloat16).copy_(v) for k, v in sent.items()}
    assert first_difference(sent, held) is None
    held["w"][0, 0] += 1.0  # element 0 is always in the strided sample
    assert first_difference(sent, held) == "w"
    assert first_difference(sent, {"w": held["w"]}) == "b"
