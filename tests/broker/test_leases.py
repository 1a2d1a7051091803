"""The lease table: grants, deadlines, reclaim, per-worker limits; plus a property test of its indexes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.broker.prompts import LeaseTable

A, B = b"worker/a", b"worker/b"


def table(timeout_s: float = 10.0, max_per_worker: int = 3) -> LeaseTable:
    return LeaseTable(timeout_s=timeout_s, max_per_worker=max_per_worker, id_prefix="t.")


def serial(lease_id: str) -> str:
    """A lease id without the MAC that binds it to its holder."""
    return lease_id.rpartition(".")[0]


def test_grant_and_lookup() -> None:
    leases = table()
    lease = leases.grant((0, 1), A, now_s=100.0)
    lease_id = lease.lease_id
    assert serial(lease_id) == "t.1" and lease.deadline_s == 110.0
    assert leases.get(lease_id) is lease and leases.of_key((0, 1)) is lease and lease_id in leases
    assert leases.count(A) == 1 and leases.room(A) == 2 and leases.room(B) == 3
    assert leases.of_worker(A) == [lease] and leases.of_worker(B) == []
    assert leases.pop(lease_id) is lease
    assert leases.pop(lease_id) is None and leases.get(lease_id) is None and len(leases) == 0
    assert leases.of_key((0, 1)) is None and leases.count(A) == 0


def test_lease_ids_bind_their_holder_and_prompt_also_after_they_end() -> None:
    leases = LeaseTable(timeout_s=10.0, max_per_worker=3, id_prefix="t.", secret=b"k" * 32)
    lease = leases.grant((0, 1), A, 0.0)
    assert leases.issued_to(lease.lease_id, (0, 1), A)
    assert not leases.issued_to(lease.lease_id, (0, 1), B)  # another worker naming it
    assert not leases.issued_to(lease.lease_id, (0, 2), A)  # another prompt
    assert not leases.issued_to("t.1", (0, 1), A) and not leases.issued_to(f"{serial(lease.lease_id)}.00", (0, 1), A)
    assert not leases.issued_to("", (0, 1), A) and not leases.issued_to("made.up", (0, 1), A)
    leases.expired(1e9)
    assert lease.lease_id not in leases and leases.issued_to(lease.lease_id, (0, 1), A)  # ended: still verifies
    again = LeaseTable(timeout_s=10.0, max_per_worker=3, id_prefix="u.", secret=b"k" * 32)  # a restarted broker
    assert again.issued_to(lease.lease_id, (0, 1), A)
    other_run = LeaseTable(timeout_s=10.0, max_per_worker=3, id_prefix="t.", secret=b"z" * 32)
    assert not other_run.issued_to(lease.lease_id, (0, 1), A)


def test_per_worker_limit() -> None:
    leases = table(max_per_worker=2)
    leases.grant((0, 0), A, 0.0)
    leases.grant((0, 1), A, 0.0)
    assert leases.room(A) == 0
    with pytest.raises(AssertionError):
        leases.grant((0, 2), A, 0.0)
    leases.grant((0, 2), B, 0.0)


@pytest.mark.parametrize("now_s, expired", [(5.0, []), (10.0, ["t.1"]), (11.9, ["t.1"]), (12.0, ["t.1", "t.2"])])
def test_expiry(now_s: float, expired: list[str]) -> None:
    leases = table(timeout_s=10.0)
    leases.grant((0, 0), A, 0.0)
    leases.grant((0, 1), B, 2.0)
    assert [serial(lease.lease_id) for lease in leases.expired(now_s)] == expired
    assert len(leases) == 2 - len(expired)
    assert leases.next_deadline_s() == (None if len(expired) == 2 else (12.0 if expired else 10.0))


def test_renewal_pushes_back_only_the_holders_listed_leases() -> None:
    leases = table(timeout_s=10.0)
    a1, a2 = leases.grant((0, 0), A, 0.0), leases.grant((0, 1), A, 0.0)
    b1 = leases.grant((0, 2), B, 0.0)
    # A names its first lease, B's lease, an ended and a made-up id: only its own live lease is renewed
    assert leases.renew(A, [a1.lease_id, b1.lease_id, "t.99.x", a1.lease_id], now_s=8.0) == 1
    assert (a1.deadline_s, a2.deadline_s, b1.deadline_s) == (18.0, 10.0, 10.0)
    assert leases.renew(B, [], 8.0) == 0 and leases.renew(b"worker/nobody", [b1.lease_id], 8.0) == 0
    assert sorted(serial(x.lease_id) for x in leases.expired(10.0)) == ["t.2", "t.3"]  # not the renewed one
    assert leases.next_deadline_s() == 18.0 and a1.lease_id in leases
    assert leases.renew(A, [a1.lease_id], now_s=5.0) == 0  # never moves a deadline earlier
    assert [x.lease_id for x in leases.expired(18.0)] == [a1.lease_id]  # a silent holder's lease still ends


def test_reclaim_and_cancel() -> None:
    leases = table()
    first = leases.grant((0, 0), A, 0.0)
    leases.grant((0, 1), A, 0.0)
    other = leases.grant((0, 2), B, 0.0)
    assert sorted(lease.key for lease in leases.reclaim(A)) == [(0, 0), (0, 1)]
    assert leases.reclaim(A) == []
    assert leases.cancel_key((0, 2)) is other and leases.cancel_key((0, 2)) is None
    assert leases.expired(1e9) == [] and leases.next_deadline_s() is None
    assert first.lease_id not in leases


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["grant", "pop", "expire", "reclaim", "cancel"]),
                              st.integers(0, 2), st.integers(0, 15)), max_size=80))
def test_indexes_stay_consistent(ops: list) -> None:
    leases = table(timeout_s=5.0, max_per_worker=4)
    workers = [b"w0", b"w1", b"w2"]
    now = 0.0
    live: dict[str, tuple[tuple[int, int], bytes, float]] = {}
    for op, w, k in ops:
        now += 1.0
        worker, key = workers[w], (0, k)
        if op == "grant" and leases.of_key(key) is None and leases.room(worker):
            lease = leases.grant(key, worker, now)
            live[lease.lease_id] = (key, worker, now + 5.0)
        elif op == "pop" and live:
            lease_id = sorted(live)[k % len(live)]
            assert leases.pop(lease_id).lease_id == lease_id
            del live[lease_id]
        elif op == "expire":
            gone = leases.expired(now)
            assert {lease.lease_id for lease in gone} == {i for i, (_, _, d) in live.items() if d <= now}
            for lease in gone:
                del live[lease.lease_id]
        elif op == "reclaim":
            for lease in leases.reclaim(worker):
                assert live.pop(lease.lease_id)[1] == worker
        elif op == "cancel":
            lease = leases.cancel_key(key)
            if lease is not None:
                assert live.pop(lease.lease_id)[0] == key
        assert len(leases) == len(live)
        for lease_id, (key_, worker_, _) in live.items():
            assert leases.of_key(key_).lease_id == lease_id and leases.get(lease_id).worker == worker_
        for worker_ in workers:
            assert leases.count(worker_) == sum(1 for v in live.values() if v[1] == worker_) <= 4
        deadlines = [d for _, _, d in live.values()]
        assert leases.next_deadline_s() == (min(deadlines) if deadlines else None)
