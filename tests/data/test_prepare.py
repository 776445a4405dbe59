"""`rlbench-nb data`: small synthetic files in the datasets' published schemas become our prompt files,
and those prompt files load and score as a run would use them."""
import json

import pytest

from rlbench_nb.cli import main
from rlbench_nb.data.datasets import read_rows
from rlbench_nb.data.prepare import prepare
from rlbench_nb.errors import RLBenchError
from rlbench_nb.rewards import boxed_math, gsm8k

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A house costs $1,200 more than a car that costs $3,000. What does the house cost?",
     "answer": "3,000 + 1,200 = <<3000+1200=4200>>4,200\n#### 4,200"},
    {"question": "A broken row", "answer": "no final line here"},
]


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_gsm8k_parquet_as_published(tmp_path, capsys):
    src = tmp_path / "gsm8k" / "main"  # the Hugging Face layout: main/{train,test}-00000-of-00001.parquet
    _parquet(src / "train-00000-of-00001.parquet", GSM8K)
    _parquet(src / "test-00000-of-00001.parquet", GSM8K[:1])
    assert main(["data", "gsm8k", str(tmp_path / "gsm8k"), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr()
    assert "train: 2 rows" in out.out and "test: 1 rows" in out.out
    assert "reward.fn=rlbench_nb.rewards:gsm8k" in out.out
    assert "skipped 1 row(s)" in out.err
    assert "train-00000-of-00001.parquet:3: its answer has no '#### <number>'" in out.err
    rows = [r for _, r in read_rows(tmp_path / "out" / "train.jsonl")[0]]
    assert [r["answer"] for r in rows] == ["72", "4200"]
    assert rows[0]["prompt"].startswith("Natalia sold") and rows[0]["prompt"].endswith('after "####".')
    assert gsm8k(rows[1]["prompt"], "So the house costs $4,200.\n#### 4,200", **{"answer": rows[1]["answer"]}) == 1.0


def test_gsm8k_original_jsonl_with_a_bad_line(tmp_path):
    src = tmp_path / "test.jsonl"
    src.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    done = prepare("gsm8k", src, tmp_path / "out")
    assert done.rows == {"test": 1} and len(done.skipped) == 1 and done.skipped[0].startswith(f"{src}:2")


def test_math_original_folder_and_math500(tmp_path):
    subject = tmp_path / "MATH" / "train" / "algebra"  # the original release: one pretty-printed JSON per problem
    subject.mkdir(parents=True)
    (subject / "1.json").write_text(json.dumps({
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1", "type": "Algebra",
        "solution": "We have $\\frac{1}{2} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$."}, indent=4))
    (subject / "2.json").write_text(json.dumps({"problem": "No box", "solution": "It is 3."}, indent=4))
    test = tmp_path / "MATH" / "test.jsonl"  # MATH-500: an answer column beside the solution
    test.write_text(json.dumps({"problem": "Find $x$ if $2x=6$.", "solution": "$x=\\boxed{3}$", "answer": "3",
                                "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}) + "\n")
    done = prepare("math", tmp_path / "MATH", tmp_path / "out")
    assert done.rows == {"train": 1, "test": 1} and len(done.skipped) == 1
    train = [r for _, r in read_rows(done.files["train"])[0]]
    assert train[0]["answer"] == "\\frac{3}{4}" and train[0]["prompt"].endswith("within \\boxed{}.")
    assert boxed_math(train[0]["prompt"], "so it is \\boxed{0.75}", train[0]["answer"]) == 1.0


def test_nothing_usable_is_one_clear_error(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"problem": "p"}) + "\n")
    with pytest.raises(RLBenchError, match="no usable gsm8k rows .* first: .*'question' and 'answer'"):
        prepare("gsm8k", src, tmp_path / "out")
    with pytest.raises(RLBenchError, match="does not exist"):
        prepare("gsm8k", tmp_path / "missing", tmp_path / "out")
