"""The built-in tool task's parts, without training: its split, tokenizer, warm-start examples and config."""
import pytest

from rlbench_nb import Config
from rlbench_nb.config import ConfigError, TaskConfig
from rlbench_nb.data.tasks import arithmetic, tool_arith
from rlbench_nb.data.tasks.warm_start import sft_step_batch


def test_four_digit_split_is_drawn_distinct_disjoint_and_the_same_every_time():
    cfg = TaskConfig(name="tool_arith", max_operand=9999)  # 10^8 problems: drawn, not listed
    train, test = arithmetic.make_split(cfg)
    assert (len(train), len(test)) == (2000, 500)
    prompts = [r["prompt"] for r in train + test]
    assert len(set(prompts)) == 2500  # no repeats, train and test disjoint
    assert max(int(p[:-1].split("+")[0]) for p in prompts) > 999  # really 4-digit operands
    a, b = train[0]["prompt"][:-1].split("+")
    assert train[0]["answer"] == str(int(a) + int(b))
    assert arithmetic.make_split(cfg) == (train, test)
    small = arithmetic.make_split(TaskConfig())  # the listed path, as before: its split must not move
    assert small[0][:2] == [{"prompt": "38+4=", "answer": "42"}, {"prompt": "15+16=", "answer": "31"}]


def test_tags_are_single_tokens_that_decoding_keeps(tmp_path):
    tok = arithmetic.make_tokenizer(tmp_path, tool_arith.TAGS)
    text = "12+34=<call>12+34</call><result>46</result>46"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 6 + 1 + 5 + 1 + 1 + 2 + 1 + 2  # every tag one token, every character one token
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_warm_start_examples_train_the_model_turns_only(tmp_path):
    tok = arithmetic.make_tokenizer(tmp_path, tool_arith.TAGS)
    row = {"prompt": "12+34=", "answer": "46"}
    batch = sft_step_batch(tok, [{"prompt": row["prompt"], "turns": tool_arith.tool_turns(row)}])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    trained = tok.decode([i for i, label in zip(ids, labels) if label != -100])
    assert trained == "<call>12+34</call>46<eos>"  # the tool's <result>46</result> carries no loss
    rows = tool_arith.sft_rows([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(1000)], 0.3, seed=0)
    episodes, probes = rows[:1000], rows[1000:]
    share = sum(len(r["turns"]) == 3 for r in episodes) / 1000
    assert 0.25 < share < 0.35  # tool_share, seeded
    assert all(r["prompt"].endswith(tool_arith.CALL) for r in probes)  # the opened call is context, not trained


def test_calculator_env_answers_a_call_and_scores_the_answer():
    env = tool_arith.CalculatorEnv()
    assert env.reset({"prompt": "4821+3907=", "answer": "8728"}) == "4821+3907="
    assert env.step("<call>4821+3907</call>") == ("<result>8728</result>", 0.0, False)
    assert env.step("8728") == (None, 1.0, True)
    assert env.calls == 1 and env.errors == 0


def test_the_tool_task_without_an_environment_says_what_to_set():
    with pytest.raises(ConfigError, match="env.fn=rlbench_nb.data.tasks.tool_arith:CalculatorEnv"):
        Config.load(None, ["task.name=tool_arith"])
