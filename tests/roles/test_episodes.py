"""Multi-turn episodes in the HF engine (roles/rollout/episodes.py) with a real model: a tiny Llama taught three
tool-using episodes, decoded greedily, talks to a real ToolEnv. The sampled ids are kept as drawn, the
environment's ids are the observation's encoding exactly, the loss mask is 1 on the model's tokens only, and an
environment that fails ends its own episode, not the batch."""
import concurrent.futures
import time

import pytest
import torch

from rlbench_nb.config import Config
from rlbench_nb.envs import ToolEnv, calculator
from rlbench_nb.roles.rollout.episodes import run_episodes
from rlbench_nb.roles.rollout.hf_engine import HFRolloutWorker
from rlbench_nb.roles.rollout.sampling import sample_next

PROMPTS = {"12+3=": "15", "40+2=": "42", "7+18=": "25"}


class Calc(ToolEnv):
    """The arithmetic tokenizer's characters only: a call is '*EXPR=', its result 'VALUE ' (then the answer)."""
    tools = [calculator]
    call_tags = ("*", "=")
    result_tags = ("", " ")
    max_turns = 3


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """The arithmetic task's tokenizer and a tiny Llama that learned each prompt's episode by heart."""
    from rlbench_nb.data.tasks.arithmetic import make_model, make_tokenizer
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    model = make_model(Config.load(None, ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2",
                                          "model.intermediate_size=128"]).model, len(tok), seed=0)
    texts = [f"{p}*{p[:-1]}={a} {a}" for p, a in PROMPTS.items()]
    batch = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    ids = torch.tensor([x + [tok.pad_token_id] * (max(map(len, batch)) - len(x)) for x in batch])
    labels = ids.masked_fill(ids == tok.pad_token_id, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, loss.item()
    return model.eval(), tok


def _run(taught, envs, rows, max_new_tokens=24, timeout_s=5.0):
    model, tok = taught
    p = Config.load(None, ["rollout.temperature=0", f"rollout.max_new_tokens={max_new_tokens}"]).rollout
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        return run_episodes(model, tok, envs, rows, p, sample_next, pool, timeout_s)
    finally:
        pool.shutdown(wait=False)  # a hung step's thread finishes on its own


def test_model_and_tool_take_turns_token_in_token_out(taught):
    _, tok = taught
    rows = [{"prompt": p, "answer": a} for p, a in PROMPTS.items()]
    envs = [Calc() for _ in rows]
    out = _run(taught, envs, rows)
    for r, (p, a) in enumerate(PROMPTS.items()):
        call, result, answer = tok.encode(f"*{p[:-1]}=", add_special_tokens=False), \
            tok.encode(f"{a} ", add_special_tokens=False), tok.encode(a, add_special_tokens=False)
        want = call + result + answer + [tok.eos_token_id]
        n = int(out["response_mask_BR"][r].sum())
        assert out["response_ids_BR"][r, :n].tolist() == want, tok.decode(out["response_ids_BR"][r, :n])
        # 1 on what the model sampled (its call, its answer and EOS), 0 on the environment's result
        assert out["loss_mask_BR"][r, :n].tolist() == [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)
        env_at = slice(len(call), len(call) + len(result))
        assert (out["rollout_logprobs_BR"][r, env_at] == 0).all()
        assert (out["rollout_logprobs_BR"][r, :len(call)] < 0).all()  # log-probs of drawn tokens (greedy: near 0)
    assert out["env_scores_B"].tolist() == [1.0, 1.0, 1.0] and out["num_turns_B"].tolist() == [2, 2, 2]
    assert out["tool_calls_B"].tolist() == [1, 1, 1] and out["tool_errors_B"].tolist() == [0, 0, 0]
    assert out["env_error"] == ["", "", ""]


def test_a_failing_environment_ends_its_own_episode_only(taught):
    class Flaky(Calc):
        def step(self, action_text):
            if self.row["prompt"] == "40+2=":
                raise ConnectionError("sandbox gone")
            if self.row["prompt"] == "7+18=":
                time.sleep(6)
            return super().step(action_text)

    rows = [{"prompt": p, "answer": a} for p, a in PROMPTS.items()]
    t0 = time.perf_counter()
    out = _run(taught, [Flaky() for _ in rows], rows, timeout_s=0.5)
    assert time.perf_counter() - t0 < 4.0  # the hung step (6 s) was not waited for
    assert out["env_error"] == ["", "Flaky.step raised ConnectionError: sandbox gone",
                                      "Flaky.step took longer than 0.5 s"]
    assert out["env_scores_B"].tolist() == [1.0, 0.0, 0.0]
    lengths = out["response_mask_BR"].sum(-1).tolist()
    assert lengths[1] == lengths[2] == len("*40+2=")  # ended right after the turn the environment failed on
    assert lengths[0] == len("*12+3=15 15") + 1


def test_an_observation_past_the_token_budget_ends_the_episode(taught):
    rows = [{"prompt": "12+3=", "answer": "15"}]
    out = _run(taught, [Calc()], rows, max_new_tokens=8)  # the call (6) + the result (3) do not fit in 8
    assert out["response_mask_BR"].sum().item() == 6 and out["loss_mask_BR"].sum().item() == 6
    assert out["env_error"] == ["the observation (3 tokens) does not fit the 2 tokens left"]


def test_the_model_reads_the_environments_tokens_as_the_trainer_will(taught):
    """Every sampled token's log-prob equals a teacher-forced forward of the whole episode (prompt, the model's
    tokens and the environment's) — the KV cache held exactly those ids; a result the model never saw in
    training ('99') makes the check bite on the tokens after it. fp32 on a CPU: the cache and the full forward
    differ by rounding only (1e-4 is far below the gap a wrong token leaves)."""
    model, tok = taught

    class Liar(Calc):
        def call(self, text):
            return "99", False

    rows = [{"prompt": p, "answer": a} for p, a in PROMPTS.items()]
    out = _run(taught, [Liar() for _ in rows], rows)
    for r in range(len(rows)):
        n = int(out["response_mask_BR"][r].sum())
        prompt = out["prompt_ids_BP"][r][out["prompt_mask_BP"][r].bool()]
        full = torch.cat([prompt, out["response_ids_BR"][r, :n]])[None]
        assert tok.decode(full[0]).startswith(f"{rows[r]['prompt']}*{rows[r]['prompt'][:-1]}=99 ")
        with torch.no_grad():
            logp = model(input_ids=full).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        want = logp.gather(-1, full[0, len(prompt):, None]).squeeze(-1)
        model_tokens = out["loss_mask_BR"][r, :n].bool()
        assert model_tokens[len("*12+3=") + 3:].any()  # the model wrote something after the result
        torch.testing.assert_close(out["rollout_logprobs_BR"][r, :n][model_tokens], want[model_tokens],
                                   rtol=0, atol=1e-4)


def test_the_rollout_worker_runs_episodes_from_its_model_folder(taught, tmp_path):
    model, tok = taught
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    cfg = Config.load(None, ["rollout.temperature=0", "rollout.max_new_tokens=24"])
    worker = HFRolloutWorker(cfg, str(tmp_path), tok.eos_token_id, tok.pad_token_id)
    out = worker.generate_episodes([{"prompt": "40+2=", "answer": "42"}] * 2, Calc)
    assert out["env_scores_B"].tolist() == [1.0, 1.0] and out["tool_calls_B"].tolist() == [1, 1]
    assert tok.decode(out["response_ids_BR"][0][out["response_mask_BR"][0].bool()]) == "*40+2=42 42<eos>"


# Cost ~22 s only when it runs first: its Session pays the run's one warm start (conftest.warm_start_cache); alone ~1 s.
def test_environment_tokens_get_no_gradient(small_cfg):
    """With a loss mask, what sits on environment tokens (their old and reference log-probs, advantages) moves
    neither the loss nor any gradient; the same change on one of the model's tokens moves both."""
    import rlbench_nb as rl
    from rlbench_nb.data.batch import trained_tokens

    with rl.Session(small_cfg("algo.kl_coef=0.1", "algo.kl_in=loss", "algo.kl_estimator=k3",
                              "algo.entropy_coef=0.01", "algo.reuse_logprobs=false")) as sess:
        batch = sess.prepare(sess.score(sess.rollout()))
        policy = sess.groups["policy"].workers[0]
    mask = batch["response_mask_BR"]
    env = torch.zeros_like(mask)
    env[:, 1:3] = mask[:, 1:3]  # call tokens 1-2 of each response the environment's
    assert env.sum() > 0
    batch["loss_mask_BR"] = mask * (1 - env)

    def loss_and_grads(b):
        policy.model.zero_grad(set_to_none=True)
        counts = {"num_tokens": trained_tokens(b).float().sum(), "num_seqs": torch.tensor(float(len(b)))}
        loss, _ = policy._loss(b, counts, kl_coef=0.1)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]

    base_loss, base_grads = loss_and_grads(batch)
    noise = {k: batch[k] + 3.0 * torch.randn_like(batch[k].float())
             for k in ("old_logprobs_BR", "ref_logprobs_BR", "advantages_BR")}
    on_env = batch.replace(**{k: torch.where(env.bool(), v, batch[k]) for k, v in noise.items()})
    loss, grads = loss_and_grads(on_env)
    assert torch.equal(loss, base_loss) and all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    model_token = (batch["loss_mask_BR"] > 0) & (torch.arange(mask.shape[1]) == 0)
    on_model = batch.replace(**{k: torch.where(model_token, v, batch[k]) for k, v in noise.items()})
    loss, grads = loss_and_grads(on_model)
    assert not torch.equal(loss, base_loss) and not all(torch.equal(a, b) for a, b in zip(grads, base_grads))


def _retry_env():
    """An Env defined inside a function, as in a cell: a wrong first answer gets the question again
    (environment tokens); right at once scores 1, right on the second try 0.5."""
    from rlbench_nb.envs import Env

    class Retry(Env):
        max_turns = 2

        def reset(self, row):
            self.tries = 0
            return super().reset(row)

        def step(self, action_text):
            self.tries += 1
            if action_text.strip() == self.row["answer"]:
                return None, 1.0 if self.tries == 1 else 0.5, True
            return (" " + self.row["prompt"], 0.0, False) if self.tries == 1 else (None, 0.0, True)
    return Retry


def test_a_session_trains_on_episodes_from_an_environment_set_in_a_cell(small_cfg):
    import rlbench_nb as rl
    from rlbench_nb.errors import UsageError
    with rl.Session(small_cfg("rollout.max_new_tokens=16")) as sess:
        before = sess.rollout()
        assert "loss_mask_BR" not in before  # no environment: single responses, as always
        sess.set_env(_retry_env())
        batch = sess.score(sess.rollout())
        assert "loss_mask_BR" in batch and batch["scores_B"].tolist() == batch["env_scores_B"].tolist()
        second = batch["num_turns_B"] == 2
        assert second.any() and (batch["num_turns_B"] >= 1).all()
        for r in second.nonzero().flatten().tolist():  # the question again, as environment tokens
            env = (batch["response_mask_BR"][r] == 1) & (batch["loss_mask_BR"][r] == 0)
            assert sess.prompts.tokenizer.decode(batch["response_ids_BR"][r][env]) == " " + batch["prompt"][r]
        prepared = sess.prepare(batch)
        assert (prepared["advantages_BR"][batch["loss_mask_BR"] == 0] == 0).all()
        import json

        from rlbench_nb.rundir import load_rollouts, rollout_rows
        path = sess.run_dir / "episodes.jsonl"  # a rollout file keeps which tokens were the environment's
        path.write_text("".join(json.dumps(r) + "\n" for r in rollout_rows(prepared)))
        assert torch.equal(load_rollouts(path)["loss_mask_BR"], batch["loss_mask_BR"])
        row = sess.step()
        assert 1 <= row["env/turns"] <= 2 and 0 < row["env/model_token_share"] <= 1 and row["env/errors"] == 0
        result = sess.evaluate(sess.test_data.rows[:8])  # greedy episodes, scored by the environment
        assert result["eval/n"] == 8 and 0 <= result["eval/reward_mean"] <= 1
        with pytest.raises(UsageError, match="not a subclass of rlbench_nb.envs.Env"):
            sess.set_env(dict)
        sess.set_env(None)
        assert "loss_mask_BR" not in sess.rollout()


def test_env_config_is_checked_before_anything_starts():
    from rlbench_nb.config import ConfigError
    from rlbench_nb.envs import load_env
    for advantage in ("gae", "reinforce_pp"):
        with pytest.raises(ValueError, match=f"algo.advantage={advantage}: per-token returns across environment"):
            Config.load(None, ["env.fn=rlbench_nb.envs:ToolEnv", f"algo.advantage={advantage}"])
    with pytest.raises(ValueError, match="episodes are not seeded per draw yet"):
        Config.load(None, ["env.fn=rlbench_nb.envs:ToolEnv", "run.deterministic=true"])
    assert Config.load(None, ["env.fn=rlbench_nb.envs:ToolEnv", "rollout.engine=vllm"]).env.fn  # both engines
    assert load_env("rlbench_nb.envs:ToolEnv") is ToolEnv
    with pytest.raises(ConfigError, match="env.fn='rlbench_nb.envs:Nope' could not be loaded"):
        load_env("rlbench_nb.envs:Nope")
    with pytest.raises(Exception, match="not a subclass of rlbench_nb.envs.Env"):
        load_env("rlbench_nb.envs:calculator")


def test_a_turn_is_cut_where_the_hf_loop_stops(tmp_path):
    """vLLM's turns come back whole; `_turn_length` cuts them at EOS or at the first token after which the
    turn's tail holds a stop string — a stop string of several tokens included."""
    from rlbench_nb.data.tasks.arithmetic import make_tokenizer
    from rlbench_nb.roles.rollout.episodes import _turn_length
    tok = make_tokenizer(tmp_path)
    ids = tok.encode("*12+3=15 15", add_special_tokens=False)
    assert _turn_length(ids, ("=",), tok, tok.eos_token_id) == len("*12+3=")
    assert _turn_length(ids, ("5 1",), tok, tok.eos_token_id) == len("*12+3=15 1")  # three tokens
    assert _turn_length(ids + [tok.eos_token_id] + ids, (), tok, tok.eos_token_id) == len(ids) + 1
    assert _turn_length(ids, ("#",), tok, tok.eos_token_id) == len(ids)  # no stop: the whole turn (budget spent)


@pytest.mark.slow  # a vLLM engine start (~30 s on 2 cores)
def test_vllm_runs_the_same_episodes_as_the_hf_engine(taught, tmp_path):
    """The taught model's greedy episodes from both engines, with a tool that lies (so the tokens after the
    result depend on the environment's tokens having been fed): the same ids, masks, scores and turns, and the
    same log-probs up to the engines' rounding (vLLM's CPU kernels vs torch's: 1e-3 is far below what a wrong
    token costs)."""
    pytest.importorskip("vllm")
    from rlbench_nb.roles.rollout.vllm_engine import VLLMRolloutWorker
    model, tok = taught
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))

    class Liar(Calc):
        def call(self, text):
            return ("99", False) if "40" in text else super().call(text)

    cfg = Config.load(None, ["rollout.temperature=0", "rollout.max_new_tokens=24", "rollout.engine=vllm"])
    rows = [{"prompt": p, "answer": a} for p, a in PROMPTS.items()]
    hf = HFRolloutWorker(cfg, str(tmp_path), tok.eos_token_id, tok.pad_token_id).generate_episodes(rows, Liar)
    engine = VLLMRolloutWorker(cfg, str(tmp_path), tok.eos_token_id, tok.pad_token_id)
    try:
        out = engine.generate_episodes(rows, Liar)
    finally:
        engine.close()
    assert tok.decode(out["response_ids_BR"][1][out["response_mask_BR"][1].bool()]).startswith("*40+2=99 ")
    for key in ("response_ids_BR", "response_mask_BR", "loss_mask_BR", "prompt_ids_BP", "prompt_mask_BP",
                "env_scores_B", "num_turns_B", "tool_calls_B"):
        assert torch.equal(out[key], hf[key]), key
    assert out["env_error"] == hf["env_error"]
    torch.testing.assert_close(out["rollout_logprobs_BR"], hf["rollout_logprobs_BR"], rtol=0, atol=1e-3)
