"""Weights between actors: one flat buffer, in the object store or in /dev/shm on the same node."""
import os
import subprocess
import sys

import torch

from rlbench_nb.cluster import transport
from rlbench_nb.cluster.transport import PackedTensors, SharedMemoryWriter


def _weights(scale=1.0):
    return {"a": torch.randn(3, 5) * scale, "b": (torch.arange(7) * scale).to(torch.bfloat16),
            "c": torch.ones(2, dtype=torch.bool), "d": torch.randn(4, 3).t() * scale, "e": torch.zeros(0),
            "f": torch.arange(3, dtype=torch.float64) * scale}


def _same(x, y):
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and torch.equal(x[k], y[k]), k


def test_packed_tensors_round_trip_every_dtype_and_layout():
    w = _weights()
    packed = PackedTensors.pack(w)
    _same(packed.unpack(), w)
    assert all(start % 64 == 0 for _, _, _, start, _ in packed.index)  # aligned for any dtype view


def test_shared_memory_is_rewritten_in_place_and_removed_on_close():
    writer = SharedMemoryWriter("test0")
    first = writer.write(_weights())
    path = first.path
    assert path.startswith("/dev/shm/") and str(os.getpid()) in path and os.path.exists(path)
    w2 = _weights(2.0)
    second = writer.write(w2)
    assert second.path == path  # same size: the same file, rewritten
    _same(second.unpack(), w2)
    # another process reads the same bytes by path (what the consumer actor does)
    code = ("import sys, pickle, torch; d = pickle.loads(sys.stdin.buffer.read()).unpack(); "
            "print(float(d['a'].sum()), float(d['f'].sum()))")
    import pickle
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(second), capture_output=True, check=True)
    a, f = map(float, out.stdout.split())
    assert abs(a - float(w2["a"].sum())) < 1e-4 and f == float(w2["f"].sum())
    bigger = writer.write({"x": torch.zeros(1000)})
    assert bigger.path != path and not os.path.exists(path)  # new size: new file, old one gone
    writer.close()
    assert not os.path.exists(bigger.path) and writer.path is None


def test_no_room_in_shared_memory_falls_back_to_the_bytes(monkeypatch):
    class Full:
        f_bavail, f_frsize = 10, 4096
    monkeypatch.setattr(transport.os, "statvfs", lambda path: Full())
    blob = transport.pack(_weights(), SharedMemoryWriter("test1"))
    assert isinstance(blob, PackedTensors) and blob.unpack()["a"].shape == (3, 5)


def test_files_of_killed_producers_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/dev/shm/{transport._PREFIX}-{dead.pid}-policy0-64.bin"
    open(stale, "wb").write(b"\0" * 64)
    mine = SharedMemoryWriter("test2")
    live = mine.write({"x": torch.ones(4)}).path
    SharedMemoryWriter("test3")  # a new producer sweeps the files of dead ones, not of live ones
    assert not os.path.exists(stale) and os.path.exists(live)
    mine.close()


def test_a_push_reuses_the_last_views_only_while_names_dtypes_and_shapes_are_the_same():
    """Both ends keep the views of the file's layout (the producer rewrites the same file in place): a push of the
    same layout lands in the views the consumer already holds; the same bytes under other names, shapes or dtypes
    (one file: the size is unchanged) get views of their own."""
    writer = SharedMemoryWriter("test4")
    try:
        first = writer.write({"a": torch.randn(3, 4)}).unpack()
        w = {"a": torch.randn(3, 4)}
        again = writer.write(w).unpack()
        assert again["a"].data_ptr() == first["a"].data_ptr() and torch.equal(again["a"], w["a"])
        for other in ({"a": torch.randn(4, 3)}, {"b": torch.randn(4, 3)}, {"b": torch.randn(4, 3).to(torch.int32)}):
            blob = writer.write(other)
            assert blob.path == writer.path  # 48 bytes each time: the same file
            _same(blob.unpack(), other)
    finally:
        writer.close()
