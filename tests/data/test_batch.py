import pytest
import torch

from rlbench_nb.data.batch import Batch


def make(n=5):
    return Batch({"x_B": torch.arange(n), "y_BT": torch.arange(n * 2).view(n, 2)},
                 {"prompt": [f"p{i}" for i in range(n)]}, {"step": 3})


def test_chunk_and_cat_round_trip():
    b = make(5)
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [3, 2]
    back = Batch.cat(parts)
    assert torch.equal(back["x_B"], b["x_B"]) and torch.equal(back["y_BT"], b["y_BT"])
    assert back["prompt"] == b["prompt"] and back.info == {"step": 3}
    assert [len(p) for p in b.split(2)] == [2, 2, 1]


def test_select_and_rows():
    b = make(4).select([3, 1])
    assert b["prompt"] == ["p3", "p1"] and b["x_B"].tolist() == [3, 1]
    assert b.rows(["prompt", "x_B"]) == [{"prompt": "p3", "x_B": 3}, {"prompt": "p1", "x_B": 1}]


def test_size_mismatch_and_missing_field_are_clear():
    with pytest.raises(ValueError, match="disagree on the batch size"):
        Batch({"a": torch.zeros(3)}, {"p": [1, 2]})
    with pytest.raises(KeyError, match="batch has no field 'nope'"):
        make()["nope"]
    with pytest.raises(ValueError, match="different fields"):
        Batch.cat([make(2), Batch({"x_B": torch.zeros(2)})])


def test_setitem_moves_between_tensor_and_meta():
    b = make(2)
    b["x_B"] = ["a", "b"]
    assert "x_B" in b.meta and "x_B" not in b.tensors
    assert "Batch(2 rows" in repr(b) and "<table" in b._repr_html_()


def test_pickled_batches_carry_their_own_bytes_and_come_back_writable():
    import copy
    import pickle
    b = Batch({"f_BT": torch.randn(6, 3), "h_B": torch.arange(6).to(torch.bfloat16),
               "g_B": torch.randn(6, requires_grad=True),  # not packed: pickled as a tensor, order kept
               "m_B": torch.ones(6, dtype=torch.bool), "t_BT": torch.randn(3, 6).t(), "e_B0": torch.zeros(6, 0)},
              {"prompt": list("abcdef")}, {"step": 1})
    for back in (pickle.loads(pickle.dumps(b)), copy.deepcopy(b)):
        assert back.info == {"step": 1} and back["prompt"] == list("abcdef") and back.keys() == b.keys()
        for k, v in b.tensors.items():
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        assert back["g_B"].requires_grad
    # a slice travels with its rows only, not the whole storage it views
    big = Batch({"x_BT": torch.zeros(1000, 100)})
    assert len(pickle.dumps(big.slice(0, 10))) < len(pickle.dumps(big)) / 50
    # bytes mapped read-only (Ray's object store) are copied before anyone writes to the batch
    state = b.__getstate__()
    mapped = [state["arrays"]["f_BT"], state["arrays"]["h_B"][2]]  # bfloat16: (dtype, shape, its bytes)
    for a in mapped:
        a.flags.writeable = False
    stores = [a.copy() for a in mapped]
    back = Batch.__new__(Batch)
    back.__setstate__(state)
    back["f_BT"].fill_(7.0)
    back["h_B"].fill_(7.0)
    assert (back["f_BT"] == 7.0).all() and (back["h_B"] == 7.0).all()
    assert all((a == store).all() for a, store in zip(mapped, stores))


def test_only_keeps_the_named_fields_and_the_info():
    b = make(3).only("x_B", "prompt")
    assert b.keys() == ["x_B", "prompt"] and b.info == {"step": 3} and len(b) == 3


def test_every_batch_info_key_the_code_uses_is_documented():
    """data/batch.py's docstring lists each `batch.info` key with its writer and reader: a key added without
    a line there fails here (found by the ways the package writes and reads them)."""
    import re

    import rlbench_nb.data.batch as batch_module
    from tests.conftest import REPO
    pattern = re.compile(r'info(?:\.get\(|\[|\.pop\()"([a-z_]+)"|info\.update\(([a-z_]+)=|k != "(kl_current)"')
    used = set()
    for path in (REPO / "rlbench_nb").rglob("*.py"):
        for m in pattern.finditer(path.read_text()):
            used.add(next(g for g in m.groups() if g))
            if m.group(2):  # info.update(a=..., b=...): every keyword
                line = path.read_text()[m.start():].split("\n", 1)[0]
                used.update(re.findall(r"([a-z_]+)=", line))
    # keys a worker group's `info` (pid, node, device, dtype, channel: cluster/) has are not a batch's
    used -= {"pid", "node", "node_id", "device", "dtype", "pool", "run_id", "channel"}
    documented = set(re.findall(r"^    ([a-z_]+)\s{2,}", batch_module.__doc__, re.M))
    assert used, "the search found no key: the pattern no longer matches how the code writes them"
    assert used <= documented, f"batch.info keys used but not in data/batch.py's docstring: {sorted(used - documented)}"
