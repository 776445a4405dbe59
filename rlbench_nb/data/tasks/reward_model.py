"""The built-in task's learned reward model (`reward.model.path: task`): PPO with a reward model, on a CPU,
with no download.

A sequence classifier of the policy's architecture (one score per sequence, read at the last token). Its body
starts from the warm start supervised further on the training prompts (to 0.95 greedy accuracy on them): a
reward model starts from a model that knows the task better than the policy it judges, as RLHF's start from a
strong SFT model. It is then trained, Bradley-Terry on (right, wrong) answers to one prompt plus BCE on single
answers, on two kinds of data: the verifier's 0/1 labels of the warm-started policy's own samples of the
training prompts, and each training prompt's right answer against answers one edit away from it (`near_misses`:
a digit changed, +-1, +-10, a digit dropped, added or swapped). It reads what the reward_model role feeds it:
prompt + response text, in the task's tokenizer, padded on the right. Held-out prompts are never used for it.

Why the near misses: trained on the policy's samples alone, the model ranked a held-out prompt's right answer
above its wrong ones 63-80% of the time, and PPO on its score alone found the answers it over-scored ("49+38=77"
scored 1.75) — held-out accuracy fell from 0.438 to 0.04-0.36 in 150 steps. The answers a policy finds that way
are near misses; with them in the data the model ranks 92% of held-out pairs right, and PPO on its score alone
(configs/arith_ppo_rm.yaml, 150 steps) raises held-out accuracy 0.438 -> 0.606 (seed 0) and -> 0.624 (seed 1).
Measured on a 2-core Xeon (AVX-512); building takes ~4-8 minutes there.

Cached beside the warm start, keyed by the same settings plus this recipe's version; rm.json records how well
it ranks one prompt's right answers above its wrong ones among the policy's samples (pairwise accuracy; 0.5 is
chance), on training prompts and on 10% of them it did not train on.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch

from ...config import ModelConfig, TaskConfig
from .warm_start import cache_key, cache_root, supervised_pass

log = logging.getLogger(__name__)
RECIPE_VERSION = 2
SAMPLES_PER_PROMPT = 8  # 4 gave held-out pairwise ranking 0.63, 8 (and more steps) 0.66
TEMPERATURE = 1.0     # the rollout's default: it learns on the distribution PPO starts from
MAX_NEW_TOKENS = 8    # answers are at most 5 characters and EOS; longer ones are wrong anyway
EPOCHS = 9            # passes over the samples (~2000 steps at the default 2000 prompts, ~2 min on 2 cores)
BATCH = 64
LR = 1e-3
PAIR_WEIGHT = 1.0
BODY_STEPS, BODY_LR, BODY_TARGET = 2000, 3e-3, 0.95
PROBE_SHARE = 0.1     # training prompts held back to measure it (not the task's held-out split)
NEAR_MISSES = 6       # per training prompt: the right answer against answers one edit away from it


@torch.no_grad()
def sample_responses(policy, tokenizer, prompts: list[str], n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, response text) for `n` samples of each prompt, as the rollout decodes them."""
    out = []
    gen = torch.Generator().manual_seed(seed)
    policy.eval()
    for i in range(0, len(prompts), 128):
        chunk = [p for p in prompts[i:i + 128] for _ in range(n)]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        ids = policy.generate(**enc, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                              max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)[:, enc["input_ids"].shape[1]:]
        for p, row in zip(chunk, ids.tolist()):
            end = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
            out.append((p, tokenizer.decode(row[:end], skip_special_tokens=True)))
    return out


def near_misses(answer: str, rng: random.Random, k: int) -> list[str]:
    """Up to `k` distinct wrong answers one edit from `answer`: a digit changed, +-1, +-10, a digit dropped or
    added, two digits swapped — the answers a policy that almost knows the sum gives, and the ones it finds
    when it hunts for what a reward model over-scores."""
    n = int(answer)
    sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
    out: set[str] = {str(n + d) for d in (1, -1, 10, -10)}
    for i in range(len(digits)):
        out |= {sign + digits[:i] + c + digits[i + 1:] for c in "0123456789"}
        out.add(sign + digits[:i] + digits[i + 1:])
        out |= {sign + digits[:i] + c + digits[i:] for c in "0123456789"}
        if i + 1 < len(digits):
            out.add(sign + digits[:i] + digits[i + 1] + digits[i] + digits[i + 2:])
    out = sorted(x for x in out if x.lstrip("-") and x != answer and x != "-0"
                 and not (len(x.lstrip("-")) > 1 and x.lstrip("-")[0] == "0"))  # no leading zeros
    return rng.sample(out, min(k, len(out)))


def _pairs(labels: list[float], per_prompt: int) -> list[tuple[int, int]]:
    """(right, wrong) index pairs among the samples of each prompt (samples come `per_prompt` at a time)."""
    out = []
    for start in range(0, len(labels), per_prompt):
        group = range(start, start + per_prompt)
        out += [(i, j) for i in group if labels[i] > 0.5 for j in group if labels[j] <= 0.5]
    return out


def _encode(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    """As the reward_model role encodes: right padding (the score is read at the last real token)."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    return {"input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in ids]),
            "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])}


@torch.no_grad()
def pairwise_accuracy(rm, tokenizer, texts: list[str], labels: list[float]) -> float:
    """Of the (right, wrong) pairs of one prompt's samples, the share it scores the right one higher (ties
    half): 1 - reward/model_disagree on these samples; 0.5 is chance."""
    rm.eval()
    scores = torch.cat([rm(**_encode(tokenizer, texts[i:i + 256])).logits[:, 0] for i in range(0, len(texts), 256)])
    pairs = _pairs(labels, SAMPLES_PER_PROMPT)
    if not pairs:
        return float("nan")
    diff = torch.stack([scores[i] - scores[j] for i, j in pairs])
    return ((diff > 0).float() + 0.5 * (diff == 0).float()).mean().item()


def build(policy_dir: Path, train_rows: list[dict], verifier, out: Path) -> dict:
    """Sample, label, train and save the reward model into `out`; returns what rm.json records."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForSequenceClassification
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    policy = AutoModelForCausalLM.from_pretrained(str(policy_dir))
    rows = list(train_rows)
    random.Random(0).shuffle(rows)
    n_probe = max(1, int(len(rows) * PROBE_SHARE))
    answers = {r["prompt"]: r["answer"] for r in rows}
    data = {}
    for split, part in (("probe", rows[:n_probe]), ("train", rows[n_probe:])):
        pairs = sample_responses(policy, tokenizer, [r["prompt"] for r in part], SAMPLES_PER_PROMPT,
                                 seed=len(data))
        data[split] = ([p + r for p, r in pairs], [verifier(p, r, answers[p]) for p, r in pairs])
    config = policy.config.__class__.from_dict({**policy.config.to_dict(), "num_labels": 1,
                                                "architectures": ["LlamaForSequenceClassification"]})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        rm = LlamaForSequenceClassification(config)
        # its body: the warm start supervised further, to BODY_TARGET — a reward model starts from a model that
        # knows the task better than the policy it will judge (as RLHF's start from a strong SFT model)
        body = AutoModelForCausalLM.from_pretrained(str(policy_dir))
        sft = supervised_pass(body, tokenizer, rows[n_probe:], BODY_STEPS, BODY_LR, BATCH, seed=1, target=BODY_TARGET)
    rm.model.load_state_dict(body.model.state_dict())
    texts, labels = data["train"]
    pairs = _pairs(labels, SAMPLES_PER_PROMPT)
    n_samples, right_share = len(texts), sum(labels) / len(labels)
    _add_near_misses(rows[n_probe:], texts, labels, pairs)
    steps = _train(rm, tokenizer, texts, labels, pairs)
    first = 256 * SAMPLES_PER_PROMPT  # the training prompts' measure, on 256 of them (their samples come first)
    report = {"body_sft_steps": sft["steps"], "body_probe_accuracy": sft["probe_accuracy"],
              "samples": n_samples, "right_share": right_share, "near_miss_texts": len(texts) - n_samples,
              "steps": steps,
              "train_pairwise": pairwise_accuracy(rm, tokenizer, texts[:first], labels[:first]),
              "probe_samples": len(data["probe"][0]),
              "probe_pairwise": pairwise_accuracy(rm, tokenizer, *data["probe"]),
              "seconds": round(time.time() - t0, 1)}
    rm.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "rm.json").write_text(json.dumps(report))
    return report


def _add_near_misses(rows: list[dict], texts: list[str], labels: list[float], pairs: list[tuple[int, int]]) -> None:
    """Hard negatives: each training prompt's right answer (label 1) against answers one edit away from it
    (label 0), appended to `texts`/`labels`, each (right, wrong) index pair to `pairs`."""
    rng = random.Random(1)
    for r in rows:
        right = len(texts)
        texts.append(r["prompt"] + r["answer"])
        labels.append(1.0)
        for wrong in near_misses(r["answer"], rng, NEAR_MISSES):
            pairs.append((right, len(texts)))
            texts.append(r["prompt"] + wrong)
            labels.append(0.0)


def _train(rm, tokenizer, texts: list[str], labels: list[float], pairs: list[tuple[int, int]]) -> int:
    """EPOCHS over `texts` in batches of BATCH, linear decay; returns the number of steps taken."""
    steps = max(1, EPOCHS * len(texts) // BATCH)
    opt = torch.optim.AdamW(rm.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    rng = random.Random(0)
    rm.train()
    for _ in range(steps):
        # Bradley-Terry on (right, wrong) answers to one prompt: what tells a prompt's samples apart is what
        # PPO learns from; a little BCE on single samples keeps 0 at the boundary between right and wrong
        chosen = [pairs[rng.randrange(len(pairs))] for _ in range(BATCH // 2)] if pairs else []
        single = [rng.randrange(len(texts)) for _ in range(BATCH - 2 * len(chosen))]
        pick = [i for i, _ in chosen] + [j for _, j in chosen] + single
        logits = rm(**_encode(tokenizer, [texts[i] for i in pick])).logits[:, 0]
        k = len(chosen)
        loss = PAIR_WEIGHT * -torch.nn.functional.logsigmoid(logits[:k] - logits[k:2 * k]).mean() if k else 0.0
        loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.tensor([labels[i] for i in pick]))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        opt.step()
        sched.step()
    return steps


def task_reward_model_dir(task: TaskConfig, model: ModelConfig, policy_dir: Path, train_rows: list[dict],
                          verifier) -> Path:
    """The folder of the built-in reward model for these settings, built on first use (~4-8 minutes on 2 cores)."""
    target = cache_root() / f"{task.name}-{cache_key(task, model)}-rm{RECIPE_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with torch.random.fork_rng():
            report = build(policy_dir, train_rows, verifier, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(target)  # atomic: a half-built cache entry is never used
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built-in reward model: %s -> %s", report, target)
    return target
