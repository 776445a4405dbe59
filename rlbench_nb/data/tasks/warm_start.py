"""The built-in warm start: a short supervised pass so RL starts from a model that is right on some
problems (like an instruct model before RL). Deterministic, and cached by its settings.

It stops at a skill level, not a step count: a few hundred supervised steps on this task cross a sharp
transition (held-out accuracy 0.2 -> 0.8 within ~150 steps), where the last bits of the arithmetic decide
how far a given step has got — at 400 steps one machine's AVX-512 kernels gave 0.84 and its AVX2 kernels
0.38. Stopping once greedy accuracy on a fixed sample of training prompts reaches
`task.warm_start_target` lands every CPU at the same skill, whichever step that takes.

Cache: $RLBENCH_NB_CACHE or ~/.cache/rlbench_nb (the only thing written outside a run directory), keyed
by the settings it is built from (the task's but task.num_test, the model's shape), torch's version and the
CPU's kernel set (a model is reused only where it would be rebuilt bit for bit: `cache_key`).
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
CACHE_VERSION = 2  # bump when the warm-start recipe changes
TOOL_RECIPE_VERSION = 1  # bump when tool_arith's episodes (tool_arith.sft_rows, its tags) change
PROBE_ROWS = 256   # training prompts the stopping rule measures (fixed, seeded): +-0.03 sampling noise
CHECK_EVERY = 10   # steps between measurements: one forward of PROBE_ROWS rows, ~10 ms


def cache_root() -> Path:
    return Path(os.environ.get("RLBENCH_NB_CACHE", Path.home() / ".cache" / "rlbench_nb"))


MODEL_SHAPE = ("hidden_size", "num_layers", "num_heads", "intermediate_size")  # what arithmetic.make_model reads


def cache_key(task: TaskConfig, model: ModelConfig) -> str:
    """The settings a built model depends on: the tool task's own (tool_share, its recipe's version) only for it.
    Not task.num_test: the training rows are the first task.num_train of one fixed draw whatever follows them
    (arithmetic.make_split), and the warm start sees only those, so any held-out size shares one model."""
    shown = task.model_dump(exclude={"num_test"} if task.name == "tool_arith" else {"tool_share", "num_test"})
    if task.name == "tool_arith":
        shown["tool_recipe"] = TOOL_RECIPE_VERSION
    # of the model's settings only its shape: the warm start builds and trains an fp32 model (make_model) whatever
    # model.dtype, model.attention or model.lora the roles load it with later
    blob = json.dumps({"v": CACHE_VERSION, "task": shown, "model": model.model_dump(include=set(MODEL_SHAPE)),
                       "torch": torch.__version__, "kernels": torch.backends.cpu.get_cpu_capability()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def sft_step_batch(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    """prompt + answer + EOS, right-padded; loss only on answer and EOS. A row with "turns" (a whole episode:
    [(text, the model wrote it), ...]) has loss on the model's turns and EOS, none on the environment's."""
    seqs, labels = [], []
    for r in rows:
        seq = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        label = [-100] * len(seq)
        for text, trained in r.get("turns") or [(r["answer"], True)]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            seq, label = seq + ids, label + (ids if trained else [-100] * len(ids))
        seqs.append(seq + [tokenizer.eos_token_id])
        labels.append(label + [tokenizer.eos_token_id])
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in seqs]),
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]),
        "labels": torch.tensor([label + [-100] * (width - len(label)) for label in labels]),
    }


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Share of rows whose greedy decoding is exactly the answer, then EOS. With teacher forcing that is
    "the argmax at every answer position is the answer's token": one forward, no decode loop."""
    batch = sft_step_batch(tokenizer, rows)
    was_training = model.training
    model.eval()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model.train(was_training)
    predicted, target = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    return ((predicted == target) | (target == -100)).all(-1).float().mean().item()


def supervised_pass(model, tokenizer, rows: list[dict], steps: int, lr: float, batch_size: int, seed: int,
                    target: float | None = None, probe: list[dict] | None = None) -> dict:
    """At most `steps` AdamW steps on random training rows, the learning rate decaying linearly to 0;
    with `target`, stops once `greedy_accuracy` on PROBE_ROWS fixed rows (of `probe`, default `rows`) reaches
    it (every CHECK_EVERY steps). Returns {"steps", "final_loss", "probe_accuracy"}."""
    rng = random.Random(seed)
    probe = random.Random(seed + 1).sample(probe or rows, min(PROBE_ROWS, len(probe or rows)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max(steps, 1))
    model.train()
    loss, accuracy, done = torch.tensor(float("nan")), None, 0
    while done < steps:
        batch = sft_step_batch(tokenizer, [rows[rng.randrange(len(rows))] for _ in range(batch_size)])
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        done += 1
        if target is not None and done % CHECK_EVERY == 0:
            accuracy = greedy_accuracy(model, tokenizer, probe)
            if accuracy >= target:
                break
    return {"steps": done, "final_loss": loss.item(), "probe_accuracy": accuracy}


def warm_started_model_dir(task: TaskConfig, model: ModelConfig, train_rows: list[dict]) -> Path:
    """Directory of the tokenizer + warm-started model for these settings, built on first use. The tool task
    (task.name=tool_arith) supervises whole episodes, a share of them calling the calculator."""
    from . import arithmetic, tool_arith
    from .arithmetic import make_model

    target = cache_root() / f"{task.name}-{cache_key(task, model)}"
    if (target / "model.safetensors").exists():
        return target
    t0 = time.time()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if task.name == "tool_arith":
        tokenizer = arithmetic.make_tokenizer(tmp, tool_arith.TAGS)
        rows, probe = tool_arith.sft_rows(train_rows, task.tool_share, seed=0), tool_arith.probe_rows(train_rows)
    else:
        tokenizer, rows, probe = arithmetic.make_tokenizer(tmp), train_rows, None
    net = make_model(model, len(tokenizer), seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        result = supervised_pass(net, tokenizer, rows, task.warm_start_steps, task.warm_start_lr,
                                 task.warm_start_batch, seed=0, target=task.warm_start_target, probe=probe)
    if result["probe_accuracy"] is not None and result["probe_accuracy"] < task.warm_start_target:
        log.warning("warm start: %d steps reached greedy accuracy %.3f, below task.warm_start_target=%.2f; "
                    "raise task.warm_start_steps", result["steps"], result["probe_accuracy"], task.warm_start_target)
    net.generation_config.pad_token_id = tokenizer.pad_token_id
    net.save_pretrained(str(tmp), safe_serialization=True)
    result.update(seconds=round(time.time() - t0, 1), kernels=torch.backends.cpu.get_cpu_capability())
    (tmp / "warm_start.json").write_text(json.dumps(result))
    try:
        tmp.rename(target)  # atomic: a half-built cache entry is never used
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("warm start: %d steps in %.1fs, probe accuracy %s -> %s", result["steps"], result["seconds"],
             result["probe_accuracy"], target)
    return target
