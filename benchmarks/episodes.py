"""Multi-turn episodes vs single responses: what the environment's turns cost the HF engine.

    python benchmarks/episodes.py                  # the tool task's warm-started model, 128 rollouts a call
    python benchmarks/episodes.py --repeats 3 --json out.json

One rollout worker (the HF engine), the built-in tool task's model (configs/arith_tool_grpo.yaml's warm start:
it calls the calculator in about a third of its samples) and the same 128 prompts (16 x n=8), three ways,
alternating within each repeat:
- `single`: `generate`, one response per prompt (the tool's tags are tokens it may still write; nothing answers);
- `episodes`: `generate_episodes` with the task's `CalculatorEnv`;
- `hung tool`: the same, a tool that sleeps past `tool_timeout_s` (0.2 s) on every call: what a misbehaving tool
  costs a batch (the episodes that called it get an error result; the others go on).
Per way: rollouts/s, all tokens/s (the model's and the environment's), model tokens/s, turns per rollout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

WAYS = ("single", "episodes", "hung tool")


def slow_calculator(expr: str) -> str:
    """A calculator that hangs.

    Args:
        expr: The expression.
    """
    time.sleep(1.0)
    return expr


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    import rlbench_nb as rl
    from rlbench_nb.data.tasks import load_task
    from rlbench_nb.data.tasks.tool_arith import CalculatorEnv
    from rlbench_nb.prompts import PromptCodec, generate_inputs

    class HungEnv(CalculatorEnv):
        tools = [slow_calculator]
        tool_timeout_s = 0.2

    cfg = rl.Config.load(rl.config.Path(__file__).parents[1] / "configs/arith_tool_grpo.yaml")
    task = load_task(cfg)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(task.model_dir)})})
    codec = PromptCodec(transformers.AutoTokenizer.from_pretrained(str(task.model_dir)), cfg.data)
    rows = task.train_rows[: args.prompts]
    batch = codec.encode(rows, cfg.rollout.n, tag="bench")
    rows_in = batch.only("prompt", *batch.info["row_fields"])
    worker = rl.roles.rollout_worker_class("hf")(cfg, str(task.model_dir), codec.tokenizer.eos_token_id,
                                                  codec.tokenizer.pad_token_id)
    calls = {"single": lambda: worker.generate(generate_inputs(batch)),
             "episodes": lambda: worker.generate_episodes(rows_in, CalculatorEnv),
             "hung tool": lambda: worker.generate_episodes(rows_in, HungEnv)}
    for fn in calls.values():
        fn()  # warm-up
    seen: dict[str, list] = {w: [] for w in WAYS}
    torch.manual_seed(0)
    for _ in range(args.repeats):
        for way in WAYS:  # alternating: the machine's drift lands on every way alike
            t = time.perf_counter()
            out = calls[way]()
            seen[way].append((time.perf_counter() - t, out))
    table = []
    for way in WAYS:
        seconds = statistics.median(s for s, _ in seen[way])
        outs = [o for _, o in seen[way]]
        tokens = statistics.mean(int(o["response_mask_BR"].sum()) for o in outs)
        model = statistics.mean(int(o.get("loss_mask_BR", o["response_mask_BR"]).sum()) for o in outs)
        turns = statistics.mean(o["num_turns_B"].float().mean().item() if "num_turns_B" in o else 1.0 for o in outs)
        calls_ = statistics.mean(o["tool_calls_B"].gt(0).float().mean().item() if "tool_calls_B" in o else 0.0
                                 for o in outs)
        table.append({"way": way, "rollouts": len(batch), "seconds": seconds, "rollouts_s": len(batch) / seconds,
                      "tok_s": tokens / seconds, "model_tok_s": model / seconds, "turns": turns,
                      "tool_use": calls_})
    print(f"HF engine, {len(batch)} rollouts a call ({args.prompts} prompts x n={cfg.rollout.n}), median of "
          f"{args.repeats}, torch threads {torch.get_num_threads()}")
    print(f"{'way':<11} {'s/call':>7} {'rollouts/s':>10} {'tok/s':>8} {'model tok/s':>11} {'turns':>6} "
          f"{'tool use':>8}")
    for r in table:
        print(f"{r['way']:<11} {r['seconds']:>7.3f} {r['rollouts_s']:>10.0f} {r['tok_s']:>8.0f} "
              f"{r['model_tok_s']:>11.0f} {r['turns']:>6.2f} {r['tool_use']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
