"""The Tinker server's request queue (rlbench_nb/serve/futures.py): order, retried submits, failures, and sample
requests that wait side by side done as one call."""
import threading

from rlbench_nb.serve.futures import Batchable, Futures


def test_requests_run_in_order_and_a_retried_submit_is_the_same_request():
    futures, done = Futures(), []
    ids = [futures.submit(lambda i=i: done.append(i) or i, key=("m", i)) for i in range(5)]
    assert futures.submit(lambda: done.append("again"), key=("m", 2)) == ids[2]
    assert [futures.wait(rid, 5) for rid in ids] == [("ok", i) for i in range(5)]
    assert done == [0, 1, 2, 3, 4]
    futures.close()


def test_a_failing_request_fails_alone():
    futures = Futures()
    bad = futures.submit(lambda: 1 / 0)
    good = futures.submit(lambda: "fine")
    state, err = futures.wait(bad, 5)
    assert state == "error" and isinstance(err, ZeroDivisionError)
    assert futures.wait(good, 5) == ("ok", "fine")
    assert futures.wait("unknown", 0.01) is None and not futures.known("unknown")
    futures.close()


def test_batchable_requests_queued_together_run_as_one_call_in_order():
    futures, gate, calls = Futures(), threading.Event(), []
    first = futures.submit(gate.wait)  # holds the worker while the others queue up behind it

    def run_many(items):
        calls.append(list(items))
        return [ValueError(f"refused {x}") if x == "b2" else x.upper() for x in items]
    a = [futures.submit(None, batch=Batchable("A", f"a{i}", run_many)) for i in range(3)]
    b = [futures.submit(None, batch=Batchable("B", f"b{i}", run_many)) for i in range(3)]
    gate.set()
    assert futures.wait(first, 5) == ("ok", True)
    assert [futures.wait(r, 5) for r in a] == [("ok", "A0"), ("ok", "A1"), ("ok", "A2")]
    assert [futures.wait(r, 5)[0] for r in b] == ["ok", "ok", "error"]  # one item refused, not its batch
    assert calls == [["a0", "a1", "a2"], ["b0", "b1", "b2"]]
    futures.close()
