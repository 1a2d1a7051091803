"""Parked long-polls: one per client (a newer request replaces the older), arrival order, heap deadlines."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.broker.outbox import Waiter, WaiterQueue


def waiter(identity: bytes, deadline_s: float, request: object = None) -> Waiter:
    return Waiter(identity=identity, request=request, deadline_s=deadline_s)


def test_one_waiter_per_identity_in_arrival_order() -> None:
    q = WaiterQueue()
    assert q.park(waiter(b"a", 10.0, "a1")) is None
    q.park(waiter(b"b", 5.0))
    replaced = q.park(waiter(b"a", 20.0, "a2"))
    assert replaced.request == "a1" and len(q) == 2
    assert [w.identity for w in q] == [b"b", b"a"] and q.first().identity == b"b"  # the newer one queues last
    assert q.next_deadline_s() == 5.0
    assert [w.identity for w in q.expired(15.0)] == [b"b"] and len(q) == 1  # a's replaced 10 s entry is void
    assert q.next_deadline_s() == 20.0 and q.remove(b"a").request == "a2" and not q and q.next_deadline_s() is None


def test_expiring_thousands_is_fast() -> None:
    q = WaiterQueue()
    for i in range(20_000):
        q.park(waiter(f"w{i}".encode(), float(i)))
    started = time.perf_counter()
    expired = q.expired(19_999.0)
    assert len(expired) == 20_000 and not q
    assert time.perf_counter() - started < 2.0  # O(n log n); the deque.remove loop took minutes for this many


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["park", "remove", "expire"]), st.integers(0, 4), st.integers(0, 30)),
                    max_size=60))
def test_matches_a_plain_model(ops: list) -> None:
    q, model = WaiterQueue(), {}  # identity -> deadline, insertion-ordered like the queue
    now = 0.0
    for op, who, value in ops:
        identity = bytes([who])
        now += 1.0
        if op == "park":
            q.park(waiter(identity, now + value))
            model.pop(identity, None)
            model[identity] = now + value
        elif op == "remove":
            assert (q.remove(identity) is None) == (identity not in model)
            model.pop(identity, None)
        else:
            gone = {w.identity for w in q.expired(now)}
            assert gone == {i for i, d in model.items() if d <= now}
            model = {i: d for i, d in model.items() if d > now}
        assert [w.identity for w in q] == list(model) and len(q) == len(model)
        assert q.next_deadline_s() == (min(model.values()) if model else None)
