"""Peak memory and time of token log-probs + entropy, forward and backward: naive full logits vs the
chunked op (rlbench_nb/ops; Triton rows on CUDA, torch rows on CPU).

    python benchmarks/logprob_memory.py                       # V = 32k and 152k, hidden 896
    python benchmarks/logprob_memory.py --tokens 256 --vocab 32000 --json out.json   # the CI smoke size

Each case runs in a fresh subprocess. Memory: on CUDA, torch's peak allocated bytes minus the inputs;
on CPU, the process's peak RSS growth over the inputs (ru_maxrss), which includes allocator slack.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
from rlbench_nb.ops import naive_logprobs_entropy, token_logprobs_entropy
method, N, H, V, chunk, dtype = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                                 sys.argv[6])
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = getattr(torch, dtype)
torch.manual_seed(0)
h = (torch.randn(N, H, device=dev) * 0.5).to(dt).requires_grad_()
W = (torch.randn(V, H, device=dev) * 0.05).to(dt).requires_grad_()
ids = torch.randint(0, V, (N,), device=dev)
def run():
    if method == "naive":
        lp, ent = naive_logprobs_entropy(h, W, ids, 0.9)
    else:
        lp, ent = token_logprobs_entropy(h, W, ids, 0.9, chunk_size=chunk)
    (lp.sum() + 0.01 * ent.sum()).backward()
    h.grad = W.grad = None
if dev == "cuda":  # a warm-up first (kernels, allocator), then the peak of one call over the inputs
    run(); torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    run(); torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
else:  # RSS peaks never come down: measure the first call
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run(); peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
t = time.perf_counter(); run()
if dev == "cuda":
    torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - t, "peak_gb": peak / 2**30, "device": dev}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="tokens per call (default 4096 on CUDA, 1024 on CPU)")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    ap.add_argument("--chunk-mb", type=float, default=256, help="MiB of fp32 logits per chunk (train.logprob_chunk_mb)")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    cuda = torch.cuda.is_available()
    tokens = args.tokens or (8192 if cuda else 2048)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    rows = []
    for V in args.vocab:
        for method in ("naive", "chunked"):
            from rlbench_nb.ops import chunk_tokens
            chunk = chunk_tokens(V, args.chunk_mb)
            out = subprocess.run([sys.executable, "-c", CHILD, method, str(tokens), str(args.hidden), str(V),
                                  str(chunk), dtype], capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{method} V={V} failed:\n{out.stderr[-2000:]}")
            rows.append({"method": method, "vocab": V, "tokens": tokens, "hidden": args.hidden, "dtype": dtype,
                         "chunk_tokens": chunk if method == "chunked" else None,
                         **json.loads(out.stdout.strip().splitlines()[-1])})
    print(f"\nlog-probs + entropy, forward + backward, {tokens} tokens, hidden {args.hidden}, {dtype}, "
          f"{rows[0]['device']}")
    print(f"{'vocab':>8} {'method':<9}{'chunk':>7}{'peak GiB':>10}{'seconds':>10}")
    for r in rows:
        print(f"{r['vocab']:>8} {r['method']:<9}{r['chunk_tokens'] or '-':>7}"
              f"{r['peak_gb']:>10.3f}{r['seconds']:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
