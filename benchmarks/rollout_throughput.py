"""Rollout throughput: our engines (HF, vLLM) vs a plain `model.generate` loop on the same prompts.

    python benchmarks/rollout_throughput.py                          # tiny + ~20M models, all engines
    python benchmarks/rollout_throughput.py --sizes tiny --engines hf plain --repeats 1 --json out.json

Models are built from a config with the built-in task's tokenizer and prompts, random init (speed needs
no training; over the 18-token vocabulary EOS comes at random, so responses stop at mixed lengths).
Per engine: completion tokens/s (median of --repeats after a warm-up call), and for the HF paths where
the time goes: prefill (a 1-token generate) vs decode, and padding waste (left-padding of prompts, and
slots decoded after a row's EOS while others go on: `generate` pays them, our engines do not).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZES = {  # name -> (ModelConfig overrides, completions per call, max new tokens)
    "tiny": (dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=256), 64, 8),
    "20m": (dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536), 256, 64),
}


def build(size: str, root: Path) -> tuple[Path, int]:
    from rlbench_nb.config import ModelConfig
    from rlbench_nb.data.tasks.arithmetic import make_model, make_tokenizer
    path = root / size
    tok = make_tokenizer(path)
    model = make_model(ModelConfig(**SIZES[size][0]), len(tok), seed=0)
    model.config.max_position_embeddings = 256
    model.save_pretrained(str(path))
    return path, sum(p.numel() for p in model.parameters())


def prompts(tok, n: int):
    from rlbench_nb.config import TaskConfig
    from rlbench_nb.data.batch import Batch
    from rlbench_nb.data.tasks.arithmetic import make_split
    rows = make_split(TaskConfig())[0][: n // 8]
    ids = [tok(r["prompt"])["input_ids"] for r in rows for _ in range(8)]
    width = max(map(len, ids))
    return Batch({"prompt_ids_BP": torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids]),
                  "prompt_mask_BP": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])})


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def measure(size: str, engine: str, path: Path, repeats: int) -> dict:
    from transformers import AutoTokenizer

    import rlbench_nb as rl
    _, n, max_new = SIZES[size]
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = rl.Config.load(None, [f"model.path={path}", f"rollout.max_new_tokens={max_new}",
                                "rollout.micro_batch_size=1024", "data.max_prompt_len=16"])
    batch = prompts(tok, n)
    row = {"size": size, "engine": engine, "completions": n, "max_new_tokens": max_new}
    if engine == "plain":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(path)).eval()

        def run():
            with torch.no_grad():
                return model.generate(input_ids=batch["prompt_ids_BP"], attention_mask=batch["prompt_mask_BP"],
                                      do_sample=True, top_k=0, max_new_tokens=max_new, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id)
        seconds, out = timed(run, repeats)
        resp = out[:, batch["prompt_ids_BP"].shape[1]:]
        is_eos = resp == tok.eos_token_id
        mask = ((is_eos.long().cumsum(-1) - is_eos.long()) == 0).long()
    else:
        cls = rl.roles.rollout_worker_class(engine)
        t = time.perf_counter()
        worker = cls(cfg, str(path), tok.eos_token_id, tok.pad_token_id)
        row["engine_start_s"] = time.perf_counter() - t
        seconds, out = timed(lambda: worker.generate(batch), repeats)
        mask = out["response_mask_BR"]
        if engine == "hf":
            one = cfg.rollout.model_copy(update={"max_new_tokens": 1})
            row["prefill_s"], _ = timed(lambda: worker.generate(batch, one), repeats)
        if hasattr(worker, "close"):
            worker.close()
    tokens = int(mask.sum())
    # slots decoded after a row's EOS: `generate` decodes the whole padded batch until the longest row
    # ends; our HF engine and vLLM stop computing a sequence at its EOS
    row.update(seconds=seconds, tokens=tokens, tok_s=tokens / seconds,
               generated_slot_waste=1 - tokens / mask.numel() if engine == "plain" else 0.0,
               prompt_pad_waste=1 - batch["prompt_mask_BP"].float().mean().item())
    if "prefill_s" in row:
        row["decode_share"] = 1 - row["prefill_s"] / seconds
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--engines", nargs="+", default=["plain", "hf", "vllm"], choices=["plain", "hf", "vllm"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="rollout_bench_"))
    rows = []
    for size in args.sizes:
        path, n_params = build(size, root)
        for engine in args.engines:
            r = measure(size, engine, path, args.repeats)
            r["params_m"] = n_params / 1e6
            rows.append(r)
    print(f"\nrollout throughput, {'cuda' if torch.cuda.is_available() else 'cpu'}, {torch.get_num_threads()} threads")
    print(f"{'size':<6}{'params':>8} {'engine':<7}{'compl x max':>12}{'seconds':>9}{'tok/s':>9}{'decode%':>9}"
          f"{'slot waste':>11}{'prompt pad':>11}{'start s':>9}")
    for r in rows:
        dec = f"{r['decode_share']:.0%}" if "decode_share" in r else "-"
        start = f"{r['engine_start_s']:.1f}" if "engine_start_s" in r else "-"
        print(f"{r['size']:<6}{r['params_m']:>7.1f}M {r['engine']:<7}{r['completions']:>6} x {r['max_new_tokens']:<3}"
              f"{r['seconds']:>9.3f}{r['tok_s']:>9,.0f}{dec:>9}{r['generated_slot_waste']:>11.0%}"
              f"{r['prompt_pad_waste']:>11.0%}{start:>9}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
