"""The policy's log-prob pass and update on padded rows vs padding-free packed rows (train.pack_sequences).

    python benchmarks/packing.py                       # the 20M Llama, 256 sequences, responses 4..64 tokens
    python benchmarks/packing.py --size tiny --reps 1 --json out.json      # the CI smoke size

One batch of GRPO rollouts (32 prompts x 8) whose responses are random tokens with lengths drawn uniformly
from --min-len to --max-len (a random-init model's own lengths say nothing about a trained one's), scored
and prepared by the session, with random advantages; then the policy worker's `compute_logprobs` and `update`
are timed on it under each layout, alternating layouts within each repetition so machine drift falls on
all. Layouts: `padded` ([B, P+R] rows, each distinct prompt run once for its 8 responses),
`padded, whole` (no prompt sharing), `packed` (padding-free rows twice the longest sequence wide), and
`packed, 4096-token micro-batches` (train.max_tokens_per_micro_batch), and `auto` (train.pack_sequences=auto,
the default: packed where padding is over a quarter of a micro-batch, else padded). Every layout computes the same
numbers (tests/roles/test_packing.py); the table gives median seconds and the speed-up over `padded`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import rlbench_nb as rl
from rlbench_nb.config import ModelConfig

SIZES = {"20m": dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536),
         "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)}
LAYOUTS = {  # name: (overrides, share the prompt prefix)
    "padded": (["train.pack_sequences=false"], True),
    "padded, whole": (["train.pack_sequences=false"], False),
    "packed": (["train.pack_sequences=true"], False),
    "packed, 4096-token micro-batches": (["train.pack_sequences=true", "train.max_tokens_per_micro_batch=4096"],
                                         False),
    "auto (the default)": ([], True),
}


def make_model(size: str, root: Path) -> Path:
    from rlbench_nb.data.tasks.arithmetic import make_model as build
    from rlbench_nb.data.tasks.arithmetic import make_tokenizer
    path = root / size
    tok = make_tokenizer(path)
    model = build(ModelConfig(**SIZES[size]), len(tok), seed=0)
    model.config.max_position_embeddings = 256  # rotary: room for long responses, same weights
    model.save_pretrained(str(path))
    return path


def varied_batch(sess, min_len: int, max_len: int, seed: int):
    """One rollout batch whose responses are replaced by random tokens (no EOS, no padding inside) of lengths
    drawn from [min_len, max_len], scored and prepared; random advantages, so the update's every term works."""
    batch = sess.rollout()
    g = torch.Generator().manual_seed(seed)
    B, vocab = len(batch), len(sess.tokenizer)
    lengths = torch.randint(min_len, max_len + 1, (B,), generator=g)
    mask = (torch.arange(max_len) < lengths[:, None]).long()
    ids = torch.randint(3, vocab, (B, max_len), generator=g) * mask  # 0 pad, 1 EOS, 2 unknown: not sampled
    batch = batch.replace(response_mask_BR=mask, response_ids_BR=ids, response_len_B=lengths,
                          rollout_logprobs_BR=torch.zeros(B, max_len))
    batch = sess.prepare(sess.score(batch))
    return batch.replace(advantages_BR=torch.randn(B, max_len, generator=g) * mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="20m", choices=list(SIZES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlbench-packing-"))
    common = [f"run.dir={root / 'runs'}", "run.tensorboard=false", "run.save_rollouts_every=0",
              f"model.path={make_model(args.size, root)}", f"data.batch_size={args.prompts}", "rollout.n=8",
              f"rollout.max_new_tokens={args.max_len}", "task.num_test=8", "train.lr=1e-5",
              "algo.reuse_logprobs=false", "train.micro_batch_size=64"]
    sess = rl.Session(rl.Config.load(None, common))
    batch = varied_batch(sess, args.min_len, args.max_len, seed=0)
    policy = sess.groups["policy"].workers[0]
    real = int(batch["prompt_mask_BP"].sum() + batch["response_mask_BR"].sum())
    padded = len(batch) * (batch["prompt_ids_BP"].shape[1] + batch["response_ids_BR"].shape[1])
    print(f"batch: {len(batch)} sequences, {real:,} real tokens in {padded:,} padded positions "
          f"({1 - real / padded:.0%} padding); model {args.size}; {torch.get_num_threads()} threads")
    times: dict[str, dict[str, list[float]]] = {name: {"logprobs": [], "update": []} for name in LAYOUTS}
    for rep in range(args.reps + 1):  # the first round warms up (allocator, kernels) and is not counted
        for name, (overrides, share) in LAYOUTS.items():
            policy.set_config(rl.Config.load(None, common + overrides))
            policy.scorer.share_prefix = share
            t0 = time.perf_counter()
            policy.compute_logprobs(batch)
            t1 = time.perf_counter()
            policy.update(batch, 0.0)
            t2 = time.perf_counter()
            if rep:
                times[name]["logprobs"].append(t1 - t0)
                times[name]["update"].append(t2 - t1)
                print(f"rep {rep} {name}: log-probs {t1 - t0:.3f} s, update {t2 - t1:.3f} s", flush=True)
    sess.close()
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    base = med["padded"]
    print(f"\n{'layout':<34}{'log-probs s':>12}{'update s':>10}{'both s':>8}{'vs padded':>11}")
    for name, m in med.items():
        both = m["logprobs"] + m["update"]
        print(f"{name:<34}{m['logprobs']:>12.3f}{m['update']:>10.3f}{both:>8.3f}"
              f"{(base['logprobs'] + base['update']) / both:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "real_tokens": real, "padded_positions": padded,
                                               "median_s": med, "runs": times}, indent=1))


if __name__ == "__main__":
    main()
