"""The Tinker server (rlbench_nb/serve/) driven by the real `tinker` SDK, unmodified, in this process: a session of
a small Qwen2-shaped chat model served on 127.0.0.1, each call checked against the same model run by hand
(`transformers`, fp32: log-probs agree to 1e-4 on any CPU), and every refusal with its message. The cookbook recipes
against `rlbench-nb serve` are tests/test_tinker_recipes.py (integration stage)."""
import http.client
import json
import math
import os

import httpx
import pytest
import torch

import rlbench_nb as rl

from ..tinker_task import gsm8k_rows, make_task_model

tinker = pytest.importorskip("tinker")
types = tinker.types
os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tinker")
    model = make_task_model(tmp / "model")
    rows = [{"prompt": r["question"], "answer": r["answer"].split("#### ")[1]} for r in gsm8k_rows(8)]
    (tmp / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    sess = rl.Session(None, [f"model.path={model}", f"data.train_path={tmp / 'data.jsonl'}", "data.max_prompt_len=64",
                             "rollout.n=2", "rollout.max_new_tokens=8", "reward.fn=rlbench_nb.rewards:gsm8k"],
                      run_dir=tmp / "run")
    srv = sess.serve_tinker()
    os.environ["TINKER_API_KEY"] = srv.api_key
    client = tinker.ServiceClient(base_url=srv.url)
    yield sess, srv, client, model
    # the SDK's own end of its session (POST /sessions/{id}/finish) stops its heartbeats: left open, they went on
    # against the closed server for the rest of the test run, which ended on a warning of a dead connection
    client.close("success").result()
    assert 0.0 in srv.backend.seen.values(), srv.backend.seen  # the server saw the client's session finish
    srv.close()
    sess.close()


@pytest.fixture(scope="module")
def trainer(served):
    sess, srv, client, model = served
    return client.create_lora_training_client(base_model=str(model), rank=32).result()


def _datum(tokens: list[int], **inputs) -> "types.Datum":
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
                                       **{k: types.TensorData.from_torch(torch.tensor(v, dtype=torch.float32))
                                          for k, v in inputs.items()}})


def _by_hand(model_dir, tokens: list[int]) -> list[float]:
    """log p(token t+1 | tokens ..t) by the model's own forward: what the server must return."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = lm(torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def test_forward_backward_returns_the_models_log_probs_and_the_summed_loss(served, trainer):
    sess, srv, client, model = served
    tokens = sess.tokenizer("What is 2 + 3? \\boxed{5}")["input_ids"]
    weights = [0.0] * (len(tokens) - 4) + [1.0, 1.0, 2.0]
    out = trainer.forward([_datum(tokens, weights=weights)], "cross_entropy").result()  # no gradient kept
    lp = out.loss_fn_outputs[0]["logprobs"].tolist()
    assert lp == pytest.approx(_by_hand(model, tokens), abs=1e-4)
    assert out.metrics["loss:sum"] == pytest.approx(-sum(w * x for w, x in zip(weights, lp)), rel=1e-5)
    assert out.loss_fn_outputs[0]["elementwise_loss"].tolist() == pytest.approx([-w * x for w, x in zip(weights, lp)],
                                                                                 abs=1e-5)


def test_policy_gradient_losses_see_the_ratio_to_the_samplers_log_probs(served, trainer):
    sess, srv, client, model = served
    tokens = sess.tokenizer("What is 1 + 1? \\boxed{2}")["input_ids"]
    lp = trainer.forward([_datum(tokens, weights=[1.0] * (len(tokens) - 1))], "cross_entropy").result() \
        .loss_fn_outputs[0]["logprobs"].tolist()
    adv = [0.0] * (len(lp) - 3) + [1.0, 1.0, 1.0]
    sampler = [x - math.log(2.0) for x in lp]  # the sampler gave each token half the probability: ratio 2
    rl_datum = _datum(tokens, logprobs=sampler, advantages=adv)
    loss = trainer.forward([rl_datum], "importance_sampling").result().metrics["loss:sum"]
    assert loss == pytest.approx(-6.0, rel=1e-4)
    assert trainer.forward([rl_datum], "ppo").result().metrics["loss:sum"] == pytest.approx(-3.6, rel=1e-4)  # 1.2 x 3
    wide = {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}
    assert trainer.forward([rl_datum], "ppo", wide).result().metrics["loss:sum"] == pytest.approx(-6.0, rel=1e-4)


def test_an_optimizer_step_is_a_session_step_the_dashboard_sees(served, trainer):
    sess, srv, client, model = served
    tokens = sess.tokenizer("What is 4 + 4? \\boxed{8}")["input_ids"]
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))
    before = sess.step_count
    first = trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()    # lr 0: Adam moves nothing
    assert trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(first, rel=1e-6)
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"] < 0.8 * first
    assert sess.step_count == before + 4
    assert json.loads((sess.run_dir / "controller_state.json").read_text())["step"] == sess.step_count  # attach's
    row = sess.history[-1]
    assert row["train/lr"] == 1e-2 and row["tinker/datums"] == 1 and row["actor/grad_norm"] > 0
    assert sess.cfg.train.lr != 1e-2   # the request's lr was for its step: the session's own stays


def test_sampling_honours_stop_tokens_and_returns_per_token_log_probs(served, trainer):
    sess, srv, client, model = served
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(sess.tokenizer("What is 3 + 1?")["input_ids"])
    vocab = list(range(len(sess.tokenizer)))
    res = sampler.sample(prompt=prompt, num_samples=4, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=1.0, stop=vocab[:200], seed=7)).result()   # most ids stop: sequences end early
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) >= 1 and all(x <= 0 for x in seq.logprobs)
        stops = [i for i, t in enumerate(seq.tokens) if t < 200]
        assert stops in ([len(seq.tokens) - 1], []) and (seq.stop_reason == "stop") == bool(stops)
    again = sampler.sample(prompt=prompt, num_samples=4, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=1.0, stop=vocab[:200], seed=7)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]  # the seed fixes the draw
    shown = srv.samples[-1]
    assert len(shown) == 4 and shown["response"][0] == sess.tokenizer.decode(again.sequences[0].tokens)


def test_a_sampler_whose_weights_moved_on_is_refused_not_served_stale(served, trainer):
    sess, srv, client, model = served
    sampler = trainer.save_weights_and_get_sampling_client().result()
    tokens = sess.tokenizer("What is 0 + 2? \\boxed{2}")["input_ids"]
    trainer.forward_backward([_datum(tokens, weights=[1.0] * (len(tokens) - 1))], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.RequestFailedError, match="save_weights_and_get_sampling_client"):
        sampler.sample(prompt=types.ModelInput.from_ints(tokens[:3]), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=2)).result()


def test_save_state_is_a_checkpoint_of_the_run_and_load_state_returns_to_it(served, trainer):
    sess, srv, client, model = served
    tokens = sess.tokenizer("What is 2 + 2? \\boxed{4}")["input_ids"]
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))
    saved_loss = trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    path = trainer.save_state("kept").result().path
    assert path.endswith("/weights/kept")
    assert any(p.name.endswith("weights-kept") for p in (sess.run_dir / "checkpoints").iterdir())
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"] != pytest.approx(saved_loss)
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(saved_loss, rel=1e-6)


def test_bad_requests_are_refused_with_a_message_and_the_server_goes_on(served, trainer):
    sess, srv, client, model = served
    tokens = sess.tokenizer("What is 1 + 2? \\boxed{3}")["input_ids"]
    with pytest.raises(tinker.RequestFailedError, match="'gspo' is not one this server computes"):
        trainer.forward_backward([_datum(tokens, logprobs=[0.0] * (len(tokens) - 1),
                                         advantages=[1.0] * (len(tokens) - 1))], "gspo").result()
    with pytest.raises(tinker.RequestFailedError, match=r"needs loss_fn_inputs \['logprobs', 'advantages'\]"):
        trainer.forward_backward([_datum(tokens, weights=[1.0] * (len(tokens) - 1))], "ppo").result()
    with pytest.raises(tinker.RequestFailedError, match="outside the model's vocabulary"):
        trainer.forward([_datum([5, 10**6, 7], weights=[1.0, 1.0])], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="holds inf or NaN"):
        trainer.forward_backward([_datum(tokens, logprobs=[math.nan] * (len(tokens) - 1),
                                         advantages=[1.0] * (len(tokens) - 1))], "importance_sampling").result()
    with pytest.raises(Exception, match="trains LoRA adapters|this server trains"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    headers = {"x-api-key": srv.api_key, "content-type": "application/json"}
    bad = httpx.post(f"{srv.url}/api/v1/optim_step", content=b"{not json", headers=headers)
    assert bad.status_code == 400 and "not JSON" in bad.json()["detail"]
    garbage = httpx.post(f"{srv.url}/api/v1/forward_backward", content=b"\xff" * 64,
                         headers={**headers, "content-type": "application/x-protobuf"})
    assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["detail"]
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)   # says 1 GiB follows: refused before reading
    conn.putrequest("POST", "/api/v1/create_model")
    for k, v in {**headers, "content-length": str(1 << 30)}.items():
        conn.putheader(k, v)
    conn.endheaders()
    assert conn.getresponse().status == 413
    assert httpx.post(f"{srv.url}/api/v1/get_info", json={"model_id": "x"}).status_code == 401  # no key
    assert httpx.post(f"{srv.url}/api/v1/get_info", json={"model_id": "x"},
                      headers={"x-api-key": "tml-wrong"}).status_code == 401
    assert httpx.get(f"{srv.url}/api/v1/healthz").json() == {"status": "ok"}
    assert trainer.forward([_datum(tokens, weights=[1.0] * (len(tokens) - 1))], "cross_entropy").result().metrics


def test_two_clients_gradients_never_meet_in_one_step(served, trainer):
    sess, srv, client, model = served
    other = client.create_lora_training_client(base_model=str(model), rank=32).result()
    tokens = sess.tokenizer("What is 3 + 3? \\boxed{6}")["input_ids"]
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))
    trainer.forward_backward([datum], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="gradients are never mixed"):
        other.forward_backward([datum], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="gradients are never mixed"):
        other.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    other.forward_backward([datum], "cross_entropy").result()   # the first client's step is done: its turn
    other.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_the_samplers_log_probs_are_the_trainers_on_the_same_tokens(served, trainer):
    """rl_loop's importance ratio is exp(trainer - sampler): on the weights it sampled with, it must be 1."""
    sess, srv, client, model = served
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = sess.tokenizer("What is 2 + 1?")["input_ids"]
    seqs = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                          sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0)).result().sequences
    ob = len(prompt) - 1
    data = [types.Datum(model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor([0] * ob + s.tokens)),
                                        "weights": types.TensorData.from_torch(torch.ones(ob + len(s.tokens)))})
            for s in seqs]
    out = trainer.forward(data, "cross_entropy").result()
    for s, o in zip(seqs, out.loss_fn_outputs):
        assert o["logprobs"].tolist()[ob:] == pytest.approx(s.logprobs, abs=1e-4)


def test_a_custom_loss_runs_through_the_sdks_two_calls_and_trains(served, trainer):
    """forward_backward_custom: the SDK's forward for the log-probs, its loss in this process, then a
    cross_entropy forward_backward weighted by the loss's gradient: a loss of -2 x sum(logprobs) gives the
    loss the model's own NLL x 2 and, after a step, lowers it."""
    sess, srv, client, model = served
    tokens = sess.tokenizer("What is 1 + 3? \\boxed{4}")["input_ids"]
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))
    nll = trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"]

    def doubled_nll(data, logprobs_list):
        loss = -2 * sum(lp.sum() for lp in logprobs_list)
        return loss, {"doubled:sum": float(loss.detach())}
    out = trainer.forward_backward_custom([datum], doubled_nll).result()
    assert out.metrics["loss:sum"] == pytest.approx(2 * nll, rel=1e-5)
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"] < nll


def test_sample_requests_done_together_give_what_each_gives_alone(served, trainer):
    """Left-padded into one engine call, prompts of different lengths decode as they do alone (greedy)."""
    sess, srv, client, model = served
    sampler_id = srv.backend.sampler("together", None, None).sampler_id   # on the policy's current weights
    greedy = {"max_tokens": 6, "temperature": 0.0}
    prompts = [sess.tokenizer(q)["input_ids"] for q in ("What is 1 + 2?", "2 + 2?", "What is 4 + 0? Say it.")]
    from tinker.proto.response_conv import deserialize_sample_response as read
    together = [read(x).sequences for x in srv.backend.sample_many([(sampler_id, p, 2, greedy) for p in prompts])]
    alone = [read(srv.backend.sample(sampler_id, p, 2, greedy)).sequences for p in prompts]
    assert [[s.tokens for s in seqs] for seqs in together] == [[s.tokens for s in seqs] for seqs in alone]
    for seqs, ref in zip(together, alone):  # padding changes the matmuls' shapes: the last bits may differ
        assert [s.logprobs for s in seqs] == [pytest.approx(r.logprobs, abs=1e-5) for r in ref]


def test_a_session_phase_between_forward_backward_and_optim_step_voids_the_gradients_loudly(served, trainer):
    """A notebook's sess.step() between a client's two calls clears and moves what its gradients were for: the
    client's optim_step is refused (nothing applied, no session step recorded), and its next try trains."""
    sess, srv, client, model = served
    tokens = sess.tokenizer("What is 2 + 0? \\boxed{2}")["input_ids"]
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))
    trainer.forward_backward([datum], "cross_entropy").result()
    sess.step()
    steps = sess.step_count
    with pytest.raises(tinker.RequestFailedError, match="changed the policy's weights since this client's"):
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert sess.step_count == steps and sess.state == "ready"
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert sess.step_count == steps + 1


def test_drop_gradients_frees_the_policy_from_a_client_that_went_away(served, trainer):
    sess, srv, client, model = served
    gone = client.create_lora_training_client(base_model=str(model), rank=32).result()
    tokens = sess.tokenizer("What is 3 + 0? \\boxed{3}")["input_ids"]
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))
    gone.forward_backward([datum], "cross_entropy").result()   # ... and never steps
    with pytest.raises(tinker.RequestFailedError, match="srv.drop_gradients"):
        trainer.forward_backward([datum], "cross_entropy").result()
    srv.drop_gradients()
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
