"""What reward isolation costs: seconds per batch of reward calls, in-process threads against worker
processes, for a trivial reward (the overhead itself) and one that works ~1 ms per call.

    python benchmarks/reward_isolation.py                  # batches of 8, 64 and 512 calls
    python benchmarks/reward_isolation.py --reps 20 --batches 64

`per call` is the batch's wall time over its calls; `overhead/call` is that minus the same batch's time
as plain calls in a loop (no isolation at all). Modes alternate rep by rep so a slower moment of the
machine hits both. The process pool is started before timing (a session starts it once, with its reward
worker); its start-up is printed on its own line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from rlbench_nb.isolation import ProcessCalls, ThreadCalls


def exact_match(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer)


def busy_1ms(prompt: str, response: str, answer: str) -> float:
    end = time.perf_counter() + 1e-3  # a verifier that parses and checks: ~1 ms of Python
    while time.perf_counter() < end:
        pass
    return float(response.strip() == answer)


def plain(fn, calls) -> None:
    for args, kwargs in calls:
        fn(*args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", help="also write the table's rows to this file")
    args = ap.parse_args()
    rows = []

    t0 = time.perf_counter()
    procs = ProcessCalls(args.processes, args.concurrency)
    procs.run(exact_match, [(("1+1=", "2"), {"answer": "2"})], timeout_s=30)  # the pool is up and warm
    print(f"process pool start ({args.processes} processes): {time.perf_counter() - t0:.3f} s")
    threads = ThreadCalls(args.concurrency)
    modes = {"plain loop": lambda fn, calls: plain(fn, calls),
             "thread": lambda fn, calls: threads.run(fn, calls, timeout_s=30),
             "process": lambda fn, calls: procs.run(fn, calls, timeout_s=30)}

    print(f"{'reward':<12}{'batch':>6}  {'mode':<11}{'ms/batch':>10}{'us/call':>10}{'overhead us/call':>18}")
    for fn in (exact_match, busy_1ms):
        for n in args.batches:
            calls = [((f"{i}+1=", str(i + 1)), {"answer": str(i + 1)}) for i in range(n)]
            times = {m: [] for m in modes}
            for _ in range(args.reps):
                for m, run in modes.items():  # alternating, rep by rep
                    t = time.perf_counter()
                    run(fn, calls)
                    times[m].append(time.perf_counter() - t)
            base = statistics.median(times["plain loop"])
            for m, ts in times.items():
                med = statistics.median(ts)
                over = "" if m == "plain loop" else f"{(med - base) / n * 1e6:18.1f}"
                print(f"{fn.__name__:<12}{n:>6}  {m:<11}{med * 1e3:10.2f}{med / n * 1e6:10.1f}{over}")
                rows.append({"reward": fn.__name__, "batch": n, "mode": m, "s_per_batch": med,
                             "overhead_s_per_call": None if m == "plain loop" else (med - base) / n})
    threads.close()
    procs.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
