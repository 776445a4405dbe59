import json

import pytest

from rlbench_nb.data.datasets import DatasetError, PromptSampler, given_rows, read_rows, validate_rows


def count_chars(s):
    return len(s)


def test_malformed_rows_are_reported_with_row_numbers(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join([
        json.dumps({"prompt": "1+1=", "answer": "2"}),   # 1 ok
        "{not json",                                        # 2 bad JSON
        json.dumps({"question": "2+2="}),                   # 3 missing prompt
        json.dumps({"prompt": 5}),                          # 4 wrong type
        json.dumps({"prompt": "   "}),                      # 5 empty
        json.dumps({"prompt": "x" * 50}),                   # 6 too long
        json.dumps(["a list"]),                             # 7 not an object
        json.dumps({"prompt": "3+4=", "answer": "7", "level": 2}),  # 8 ok, extra field kept
    ]) + "\n")
    numbered, problems = read_rows(p)
    ds = validate_rows(numbered, "prompt", 10, count_chars, str(p), problems)
    assert [r["prompt"] for r in ds.rows] == ["1+1=", "3+4="] and ds.rows[1]["level"] == 2
    assert {pr.row: pr.reason.split(" ")[0] for pr in ds.problems} == {
        2: "not", 3: "missing", 4: "'prompt'", 5: "empty", 6: "prompt", 7: "expected"}
    report = ds.report()
    assert "2 rows kept, 6 skipped" in report and "row 2: not valid JSON" in report
    assert "row 6: prompt has 50 tokens > data.max_prompt_len=10" in report


def test_no_good_rows_is_an_error_naming_the_file(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "a"}) + "\n")
    numbered, problems = read_rows(p)
    with pytest.raises(DatasetError,
                       match=r"bad.jsonl: 0 rows kept, 1 skipped \(row 1: missing field 'prompt'.*no usable rows"):
        validate_rows(numbered, "prompt", 10, count_chars, str(p), problems)
    with pytest.raises(DatasetError, match="dataset file not found"):
        read_rows(tmp_path / "nope.jsonl")


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["1+2=", ""], "answer": ["3", "0"]}), p)
    numbered, problems = read_rows(p)
    ds = validate_rows(numbered, "q", 10, count_chars, str(p), problems)
    assert ds.rows == [{"q": "1+2=", "answer": "3", "prompt": "1+2="}]
    assert ds.problems[0].row == 2  # the second record (rows count from 1 in every format)


def test_sampler_epochs_and_resume():
    s = PromptSampler(5, 3, seed=7)
    first = [s.next_indices() for _ in range(4)]
    flat = [i for b in first for i in b]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))  # each epoch a permutation
    assert flat[:5] != flat[5:10]  # reshuffled per epoch
    s2 = PromptSampler(5, 3, seed=7)
    s2.next_indices()
    state = s2.state_dict()
    s3 = PromptSampler(5, 3, seed=7)
    s3.load_state_dict(state)
    assert [s3.next_indices() for _ in range(3)] == first[1:]
    assert PromptSampler(4, 2, seed=0, shuffle=False).next_indices() == [0, 1]


def test_files_are_read_by_content_with_every_bad_row_reported(tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    jsonl = "\n".join(json.dumps(r) for r in rows) + "\n"
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl.encode()))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.pq")
    (tmp_path / "c.json").write_text(json.dumps(rows))
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + jsonl.encode())  # a byte-order mark
    for name in ("a.jsonl.gz", "b.pq", "c.json", "d.jsonl"):
        numbered, problems = read_rows(tmp_path / name)
        assert [r for _, r in numbered] == rows and not problems, name
    latin1 = tmp_path / "e.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "caf\u00e9=", "answer": "1"}, ensure_ascii=False).encode("latin-1")
                       + b"\n" + json.dumps(rows[0]).encode() + b"\n")
    numbered, problems = read_rows(latin1)
    assert [r for _, r in numbered] == [rows[0]] and problems[0].row == 1 and "not UTF-8" in problems[0].reason


def test_unusual_prompts_cost_their_row_not_the_file_or_the_time(tmp_path):
    import time
    rows = [(1, {"prompt": "\ud800=", "answer": "1"}), (2, {"prompt": "x" * 10_000_000}), (3, {"prompt": "1+1="})]

    def tokens(s):  # a tokenizer's view: lone surrogates cannot be encoded
        return len(s.encode("utf-8"))
    t = time.perf_counter()
    ds = validate_rows(rows, "prompt", 10, tokens, "f.jsonl", max_chars_per_token=5)
    assert time.perf_counter() - t < 1.0  # the 10 MB prompt is refused by its length, never tokenised
    assert [r["prompt"] for r in ds.rows] == ["1+1="]
    assert "cannot be tokenised" in ds.problems[0].reason and "10000000 characters" in ds.problems[1].reason


def test_a_row_field_that_clashes_with_the_phases_is_refused_naming_it(tmp_path):
    rows = [(1, {"prompt": "1+1=", "group": "easy"})]
    with pytest.raises(DatasetError, match=r"f.jsonl: row 1 has a field named 'group'.*rename it"):
        validate_rows(rows, "prompt", 10, count_chars, "f.jsonl")


def test_rows_given_to_a_phase_are_checked_strictly_and_named_by_index():
    """A file's bad rows are skipped; rows a caller hands sess.rollout / sess.evaluate are each chosen, so one bad
    row refuses the call, naming it by its index and saying what a row is."""
    good = {"prompt": "1+1=", "answer": "2"}
    assert given_rows([good, {"prompt": "2+2="}], "prompt", 10, count_chars, "f(rows)") == [good, {"prompt": "2+2="}]
    assert given_rows(({"q": "1+1="},), "q", 10, count_chars, "f(rows)") == [{"q": "1+1=", "prompt": "1+1="}]
    assert given_rows([{"prompt": "1+1="}], "q", 10, count_chars, "f(rows)") == [{"prompt": "1+1="}]
    # a loaded row holds both; its prompt edited in a cell is the one the phases read
    edited = {"q": "1+1=", "prompt": "Think. 1+1="}
    assert given_rows([edited], "q", 20, count_chars, "f(rows)") == [edited]
    cases = {
        "takes a list of rows, each a dict with a 'prompt' string.*got dict": {"prompt": "1+1="},
        "takes a list of rows.*got str": "1+1=",
        "takes a list of rows.*got int": 3,
        r"got no rows: give at least one.*or none \(rows=None\)": [],
        r"rows\[1\]: expected a dict \(a JSON object\), got str": [good, "1+1="],
        r"rows\[0\]: missing field 'prompt' \(fields: \['promt'\]\)": [{"promt": "1+1="}],
        r"rows\[0\]: 'prompt' must be a string, got int": [{"prompt": 12}],
        r"rows\[0\]: empty 'prompt'": [{"prompt": "  "}],
        r"rows\[0\]: prompt has 11 tokens > data.max_prompt_len=10": [{"prompt": "x" * 11}],
        r"rows\[0\]: has a field named 'group'.*rename it, e.g. to 'group_'": [{"prompt": "1+1=", "group": "a"}],
        r"rows\[0\]: .*; rows\[1\]: .*; rows\[2\]: .* \(and 2 more\)\. Each row is": [{"x": i} for i in range(5)],
    }
    for pattern, rows in cases.items():
        with pytest.raises(DatasetError, match=r"^f\(rows\)[ :].*" + pattern):
            given_rows(rows, "prompt", 10, count_chars, "f(rows)")
    with pytest.raises(DatasetError, match=r"rows\[0\]: missing field 'q' or 'prompt'.*a dict with a 'q' string"):
        given_rows([{"question": "1+1="}], "q", 10, count_chars, "f(rows)")
    for row in ("1+1=", 3):  # not a dict, under a prompt_key of the config's own
        with pytest.raises(DatasetError, match=rf"rows\[0\]: expected a dict .*, got {type(row).__name__}"):
            given_rows([row], "q", 10, count_chars, "f(rows)")
