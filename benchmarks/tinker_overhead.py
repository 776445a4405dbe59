"""The Tinker server's HTTP hop: each call through the real `tinker` SDK against the same work called in-process.

    python benchmarks/tinker_overhead.py                 # tiny (0.66M) and 20M Llama, 5 repetitions each
    python benchmarks/tinker_overhead.py --models tiny --reps 10

For each model, one local session served on 127.0.0.1. `direct` calls the server's own backend in this process
(TinkerBackend: the same worker calls, no SDK, no HTTP, no futures); `sdk` is the SDK's call and `.result()`, with
its protobuf, HTTP, future and poll. Both do identical work on identical inputs: `forward_backward` (importance
sampling on prompts x group samples, forward only so the weights stay put), `optim_step` at lr 0, and `sample`
(one prompt, the group). `rl step`: rl_loop.py's step through the SDK (sample every prompt, score, centre, one
forward_backward + optim_step) against `sess.step()` on the same prompts, group size and token cap (its rollout,
score, prepare and update). Medians, seconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

import rlbench_nb as rl
from rlbench_nb.serve.wire import Datum

MODELS = {"tiny": [], "20m": ["model.hidden_size=512", "model.num_layers=6", "model.num_heads=8",
                              "model.intermediate_size=1536", "task.warm_start_steps=0"]}
WORK = ["data.batch_size=8", "rollout.n=8", "rollout.max_new_tokens=8", "algo.reuse_logprobs=true",
        "run.save_rollouts_every=0", "run.tensorboard=false", "run.eval_every=0", "cluster.num_threads=2"]


def paired(direct, sdk, reps: int) -> tuple[float, float]:
    """Median seconds of each, the two alternating (neither always runs first), after one warm-up each."""
    times = {direct: [], sdk: []}
    for i in range(reps + 1):
        for fn in ((direct, sdk) if i % 2 else (sdk, direct)):
            t0 = time.perf_counter()
            fn()
            if i:
                times[fn].append(time.perf_counter() - t0)
    return statistics.median(times[direct]), statistics.median(times[sdk])


def data_from(batch):
    """The session's own rollout as Tinker datums (rl_loop.py's layout) and as the server's wire Datums."""
    from tinker import types
    sdk, wire = [], []
    for row in range(len(batch)):
        p = batch["prompt_ids_BP"][row][batch["prompt_mask_BP"][row].bool()].tolist()
        r = batch["response_ids_BR"][row][batch["response_mask_BR"][row].bool()].tolist()
        lp = batch["rollout_logprobs_BR"][row][: len(r)].tolist()
        ob = len(p) - 1
        inputs = {"target_tokens": [0] * ob + r, "logprobs": [0.0] * ob + lp,
                  "advantages": [0.0] * ob + [0.5] * len(r)}
        dtypes = {k: torch.int64 if k == "target_tokens" else torch.float32 for k in inputs}
        sdk.append(types.Datum(model_input=types.ModelInput.from_ints(p + r[:-1]), loss_fn_inputs={
            k: types.TensorData.from_torch(torch.tensor(v, dtype=dtypes[k])) for k, v in inputs.items()}))
        wire.append(Datum(np.array(p + r[:-1], dtype=np.int64),
                          {k: np.array(v, dtype=np.int64 if k == "target_tokens" else np.float32)
                           for k, v in inputs.items()}))
    return sdk, wire


def rl_step_sdk(sess, trainer, tok, rows, n, max_tokens):
    from tinker import types
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[tok.eos_token_id])
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=n, sampling_params=params)
               for p in prompts]
    datums = []
    for row, p, f in zip(rows, prompts, futures):
        seqs = f.result().sequences
        scores = [sess.reward_fn(row["prompt"], tok.decode(s.tokens, skip_special_tokens=True), row["answer"])
                  for s in seqs]
        mean = sum(scores) / len(scores)
        for s, r in zip(seqs, scores):
            ob = len(p) - 1
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(p + s.tokens[:-1]), loss_fn_inputs={
                "target_tokens": types.TensorData.from_torch(torch.tensor([0] * ob + s.tokens)),
                "logprobs": types.TensorData.from_torch(torch.tensor([0.0] * ob + s.logprobs)),
                "advantages": types.TensorData.from_torch(torch.tensor([0.0] * ob + [r - mean] * len(s.tokens)))}))
    trainer.forward_backward(datums, loss_fn="importance_sampling").result()
    trainer.optim_step(types.AdamParams(learning_rate=sess.cfg.train.lr)).result()


def measure(name: str, reps: int) -> list[tuple]:
    import tinker
    from tinker import types
    with tempfile.TemporaryDirectory() as tmp:
        sess = rl.Session("configs/arith_grpo.yaml", [*WORK, *MODELS[name]], run_dir=f"{tmp}/run")
        srv = sess.serve_tinker()
        os.environ.update(srv.env)
        trainer = tinker.ServiceClient().create_lora_training_client(base_model="rlbench-nb/task", rank=32).result()
        model_id = trainer.model_id
        backend = srv.backend
        sdk_data, wire_data = data_from(sess.rollout())
        cfg = {}
        zero = types.AdamParams(learning_rate=0.0)
        prompt = sess.tokenizer(sess.train_data.rows[0]["prompt"])["input_ids"]
        sp = types.SamplingParams(max_tokens=8, temperature=1.0)
        n = sess.cfg.rollout.n
        rows = []
        rows.append(("forward_backward", len(wire_data), *paired(
            lambda: backend.forward_backward(model_id, wire_data, "importance_sampling", cfg, True),
            lambda: trainer.forward(sdk_data, "importance_sampling").result(), reps)))
        rows.append(("optim_step", 0, *paired(lambda: backend.optim_step(model_id, zero.model_dump()),
                                              lambda: trainer.optim_step(zero).result(), reps)))
        sampler = trainer.save_weights_and_get_sampling_client().result()  # after the steps: their weights
        sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=sp).result()
        sampler_id = next(k for k in reversed(backend.samplers) if ":sample:" in k)  # the one the SDK's holds
        rows.append(("sample", n, *paired(
            lambda: backend.sample(sampler_id, prompt, n, {"max_tokens": 8}),
            lambda: sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=n,
                                   sampling_params=sp).result(), reps)))
        step_rows = sess.train_data.rows[: sess.cfg.data.batch_size]
        rows.append(("rl step", len(step_rows) * n, *paired(
            sess.step, lambda: rl_step_sdk(sess, trainer, sess.tokenizer, step_rows, n, 8), reps)))
        srv.close()
        sess.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    print(f"{'model':6} {'method':18} {'rows':>5} {'direct s':>9} {'sdk s':>8} {'hop ms':>8} {'sdk/direct':>10}")
    out = []
    for name in args.models:
        for call, n, direct, sdk in measure(name, args.reps):
            out.append({"model": name, "method": call, "rows": n, "direct_s": direct, "sdk_s": sdk})
            hop_ms = 1000 * (sdk - direct)
            print(f"{name:6} {call:18} {n:5d} {direct:9.4f} {sdk:8.4f} {hop_ms:8.1f} {sdk / direct:9.2f}x")
    print("rl step: 'direct' is sess.step() (rollout, score, prepare, update); 'sdk' is rl_loop.py's step via the SDK")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
