"""The shipped recipes run as written on a random model of the architecture they name (tests/chat_model.py):
configs/gsm8k_grpo.yaml with data prepared by `rlbench-nb data gsm8k` from a published-schema file."""
import json

import rlbench_nb as rl
from rlbench_nb.cli import main

from .chat_model import make_chat_model
from .conftest import REPO

QUESTIONS = [(f"Tom has {a} apples and buys {b} more. How many apples does he have now?", a + b)
             for a, b in [(3, 4), (12, 30), (7, 8), (25, 17), (1, 1), (40, 2), (9, 9), (60, 15)]]


def _published_gsm8k(path):
    """GSM8K's own JSONL schema: the answer is a worked solution ending in '#### n'."""
    with path.open("w") as f:
        for q, n in QUESTIONS:
            f.write(json.dumps({"question": q, "answer": f"He has <<{n}={n}>>{n} apples.\n#### {n}"}) + "\n")


def test_gsm8k_recipe_runs_on_a_qwen_shaped_chat_model(tmp_path, capsys):
    raw = tmp_path / "gsm8k"
    raw.mkdir()
    _published_gsm8k(raw / "train.jsonl")
    _published_gsm8k(raw / "test.jsonl")
    assert main(["data", "gsm8k", str(raw), "-o", str(tmp_path / "data")]) == 0
    model = make_chat_model(tmp_path / "model", [q for q, _ in QUESTIONS] * 20 + ["#### 42 The answer is"] * 20)
    cfg = rl.Config.load(REPO / "configs/gsm8k_grpo.yaml", [
        f"model.path={model}", f"data.train_path={tmp_path / 'data/train.jsonl'}",
        f"data.test_path={tmp_path / 'data/test.jsonl'}", f"run.dir={tmp_path / 'runs'}", "run.tensorboard=false",
        # the recipe's own settings but for its size: 4 questions x 4 answers, 24 new tokens
        "data.batch_size=4", "rollout.n=4", "rollout.max_new_tokens=24", "run.eval_every=0"])
    with rl.Session(cfg) as sess:
        batch = sess.rollout()
        prompt = sess.tokenizer.decode(batch["prompt_ids_BP"][0][batch["prompt_mask_BP"][0].bool()])
        assert prompt.startswith("<|im_start|>system\n") and "<|im_start|>user\nTom has" in prompt
        assert prompt.endswith('after "####".<|im_end|>\n<|im_start|>assistant\n')
        scored = sess.score(batch)
        assert not any(scored["reward_error"]) and set(scored["answer"]) <= {str(n) for _, n in QUESTIONS}
        right = scored.replace(response=[f"#### {a}" for a in scored["answer"]])  # the reward reads the row's answer
        assert sess.score(right)["scores_B"].tolist() == [1.0] * len(batch)
        summary = sess.run(steps=2, progress=False)
        row = sess.history[-1]
        assert summary["steps"] == 2 and "kl/ref" in row and "mismatch/is_weight_mean" in row
