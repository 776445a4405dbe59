"""The built-in warm start: a short supervised pass so RL starts from a model that is right on some
problems (like an instruct model before RL). Deterministic, and cached by its settings.

Cache: $RLBENCH_NB_CACHE or ~/.cache/rlbench_nb (the only thing written outside a run directory).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch

from ...config import ModelConfig, TaskConfig

log = logging.getLogger(__name__)
CACHE_VERSION = 1  # bump when the warm-start recipe changes


def cache_root() -> Path:
    return Path(os.environ.get("RLBENCH_NB_CACHE", Path.home() / ".cache" / "rlbench_nb"))


def cache_key(task: TaskConfig, model: ModelConfig) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "task": task.model_dump(), "model": model.model_dump(exclude={"path"})},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def sft_step_batch(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    """prompt + answer + EOS, right-padded; loss only on answer and EOS."""
    seqs, labels = [], []
    for r in rows:
        p = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        a = tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in seqs]),
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]),
        "labels": torch.tensor([l + [-100] * (width - len(l)) for l in labels]),
    }


def supervised_pass(model, tokenizer, rows: list[dict], steps: int, lr: float, batch_size: int, seed: int) -> float:
    """`steps` AdamW steps on random training rows, learning rate decaying linearly to 0; returns last loss."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max(steps, 1))
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        batch = sft_step_batch(tokenizer, [rows[rng.randrange(len(rows))] for _ in range(batch_size)])
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return loss.item()


def warm_started_model_dir(task: TaskConfig, model: ModelConfig, train_rows: list[dict]) -> Path:
    """Directory of the tokenizer + warm-started model for these settings, built on first use."""
    from .arithmetic import make_model, make_tokenizer

    target = cache_root() / f"{task.name}-{cache_key(task, model)}"
    if (target / "model.safetensors").exists():
        return target
    t0 = time.time()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = make_tokenizer(tmp)
    net = make_model(model, len(tokenizer), seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        last = supervised_pass(net, tokenizer, train_rows, task.warm_start_steps, task.warm_start_lr,
                               task.warm_start_batch, seed=0)
    net.generation_config.pad_token_id = tokenizer.pad_token_id
    net.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "warm_start.json").write_text(json.dumps(
        {"steps": task.warm_start_steps, "final_loss": last, "seconds": round(time.time() - t0, 1)}))
    try:
        tmp.rename(target)  # atomic: a half-built cache entry is never used
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("warm start: %d steps in %.1fs, loss %.3f -> %s", task.warm_start_steps, time.time() - t0, last, target)
    return target
