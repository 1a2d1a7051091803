"""The group ledger: its transition table, one row at a time, and a property test over random event sequences
(the stores agree, bounds hold, a prompt is never in two states, exactly-once across snapshot and restore)."""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.broker.buffer import RolloutBuffer, StoredGroup
from loraflow.broker.ledger import LEASE_ENDINGS, RULES, GroupLedger, Reason, State
from loraflow.broker.prompts import LeaseTable, PromptSource, group_id_of
from tests.broker.test_prompts import ListTask

W1, W2 = b"worker/w1", b"worker/w2"


def make_ledger(epoch_size: int = 50, num_epochs: int = 0, max_groups: int = 6, max_bytes: int = 1000,
                cursor: tuple[int, int] = (0, 0), requeued: tuple = (),
                counts: Counter | None = None) -> GroupLedger:
    counts = Counter() if counts is None else counts
    return GroupLedger(PromptSource(ListTask(epoch_size), num_epochs=num_epochs, reserve_block=4, cursor=cursor,
                                    requeued=requeued),
                       buffer=RolloutBuffer(max_groups=max_groups, max_bytes=max_bytes, group_overhead_bytes=10),
                       leases=LeaseTable(timeout_s=5, max_per_worker=100, secret=b"k"),
                       count=lambda family, event, n=1: counts.update({f"{family}.{event}": n}))


def group(key: tuple[int, int], num_bytes: int = 50, min_version: int = 0, worker: str = "w1") -> StoredGroup:
    return StoredGroup(group_id=group_id_of(key), key=key, header={}, wire_specs=[], frames=[bytes(num_bytes)],
                       num_bytes=num_bytes, min_version=min_version, worker=worker, session="s")


def test_every_rule_names_a_reason_and_lease_endings_requeue() -> None:
    assert set(RULES) == set(Reason)
    assert LEASE_ENDINGS == {Reason.EXPIRED, Reason.RETURNED, Reason.RECLAIMED, Reason.REFUSED,
                             Reason.UNDELIVERABLE, Reason.QUARANTINED}
    assert all(RULES[r].target is State.QUEUED for r in LEASE_ENDINGS)
    assert all(State.TRAINED not in RULES[r].sources for r in Reason if r is not Reason.ROLLED_BACK)


@pytest.mark.parametrize("path, state, counters", [
    (["grant"], State.LEASED, {"leases.granted": 1}),
    (["grant", "return"], State.QUEUED, {"leases.granted": 1, "leases.returned": 1}),
    (["grant", "accept"], State.BUFFERED, {"leases.granted": 1, "leases.submitted": 1, "groups.accepted": 1}),
    (["grant", "return", "accept"], State.BUFFERED, {"leases.granted": 1, "leases.returned": 1,
                                                     "groups.accepted": 1}),
    (["grant", "accept", "serve"], State.TRAINING, {"groups.served": 1}),
    (["grant", "accept", "serve", "unserve"], State.BUFFERED, {"groups.restored": 1}),
    (["grant", "accept", "serve", "trained"], State.TRAINED, {"groups.trained": 1}),
    (["grant", "accept", "serve", "unlisted"], State.QUEUED, {"dropped.not_trained": 1}),
    (["grant", "accept", "serve", "failed"], State.QUEUED, {"dropped.policy_mismatch": 1}),
    (["grant", "accept", "stale"], State.QUEUED, {"dropped.stale": 1}),
    (["grant", "accept", "quarantine"], State.QUEUED, {"dropped.policy_mismatch": 1}),
    (["grant", "mark_trained"], State.TRAINED, {"leases.cancelled": 1, "groups.trained": 1}),
    (["grant", "accept", "serve", "trained", "roll_back"], State.QUEUED, {"groups.trained": 1}),
])
def test_transitions(path: list[str], state: State, counters: dict[str, int]) -> None:
    counts: Counter = Counter()
    ledger = make_ledger(counts=counts)
    key = (0, 0)
    lease = None
    for step in path:
        if step == "grant":
            lease = ledger.grant(W1, 0.0)
        elif step == "return":
            assert ledger.end_lease(lease, Reason.RETURNED) and not ledger.end_lease(lease, Reason.RETURNED)
        elif step == "accept":
            ledger.accept(group(key, min_version=0), lease.lease_id)
        elif step == "serve":
            assert ledger.serve(1, "b1") is not None
        elif step == "unserve":
            assert [g.key for g in ledger.unserve("b1")] == [key]
        elif step in ("trained", "unlisted", "failed"):
            gid = group_id_of(key)
            assert ledger.settle("b1", {gid} if step == "trained" else set(),
                                 {gid} if step == "failed" else set())[0][1] is (step == "trained")
        elif step == "stale":
            assert len(ledger.drop_stale(latest_version=5, max_staleness=1)) == 1
        elif step == "quarantine":
            assert len(ledger.drop_from("w1", "s")) == 1
        elif step == "mark_trained":
            assert ledger.mark_trained(key) and not ledger.mark_trained(key)
        elif step == "roll_back":
            assert ledger.roll_back(key) and not ledger.roll_back(key)
        ledger.check()
    assert ledger.state(key) is state
    assert {k: v for k, v in counts.items() if k in counters} == counters
    assert ledger.num_changes == len(path)


def test_a_transition_from_a_state_its_rule_does_not_allow_is_a_bug() -> None:
    ledger = make_ledger()
    ledger.grant(W1, 0.0)
    with pytest.raises(AssertionError, match="served from leased"):
        ledger._move((0, 0), Reason.SERVED)


def test_restored_requeues_pending_and_the_reserved_block_never_a_trained_key() -> None:
    ledger = make_ledger()
    leases = [ledger.grant(W1, 0.0) for _ in range(3)]  # reserves [0:0, 0:4)
    ledger.accept(group((0, 0)), leases[0].lease_id)
    ledger.serve(1, "b1")
    ledger.settle("b1", {"0:0"}, set())
    source = ledger.source
    again = GroupLedger.restored(partial(PromptSource, ListTask(50), reserve_block=4), cursor=source.cursor,
                                 reserved_until=source.reserved_until, pending=ledger.pending_keys(), num_epochs=0,
                                 buffer=RolloutBuffer(max_groups=6, max_bytes=1000),
                                 leases=LeaseTable(timeout_s=5, max_per_worker=10))
    assert again.state((0, 0)) is State.TRAINED
    assert [again.state((0, i)) for i in (1, 2, 3)] == [State.QUEUED] * 3  # 0:3 was only reserved
    assert again.source.cursor == (0, 4)
    again.check()


EVENTS = ["grant", "grant", "end", "expire", "accept", "accept", "serve", "unserve", "settle", "mark_trained",
          "stale", "quarantine", "roll_back", "restart"]


@settings(max_examples=150, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(EVENTS), st.integers(0, 1000), st.integers(0, 1000)),
                       max_size=80),
       epoch_size=st.sampled_from([3, 7, 50]), num_epochs=st.sampled_from([0, 2]),
       max_groups=st.integers(1, 6), max_bytes=st.sampled_from([100, 400, 5000]))
def test_every_event_sequence_keeps_the_invariants(events: list, epoch_size: int, num_epochs: int,
                                                   max_groups: int, max_bytes: int) -> None:
    """No prompt in two states (the stores agree), bounds hold, every prompt is trained at most once and, across
    a restart from the persisted cursor / reserved block / pending keys, no trained one comes back and no
    pending one is lost."""
    def build(cursor: tuple[int, int] = (0, 0), requeued: tuple = ()) -> GroupLedger:
        return make_ledger(epoch_size, num_epochs, max_groups, max_bytes, cursor=cursor, requeued=requeued)

    ledger = build()
    trained: set[tuple[int, int]] = set()
    now, version, batches = 0.0, 0, 0
    for event, a, b in events:
        pending = ledger.pending_keys()
        pick = pending[a % len(pending)] if pending else None
        if event == "grant":
            lease = ledger.grant(W1 if a % 2 else W2, now)
            if lease is None:
                assert ledger.available(1) == 0
            else:
                assert lease.key not in trained, "a trained prompt was leased again"
        elif event == "end" and len(ledger.leases):
            lease = list(ledger.leases)[a % len(ledger.leases)]
            assert ledger.end_lease(lease, sorted(LEASE_ENDINGS)[b % len(LEASE_ENDINGS)])
        elif event == "expire":
            now += b % 7
            for lease in ledger.expire(now):
                assert ledger.state(lease.key) is State.QUEUED
        elif event == "accept" and pick is not None and ledger.state(pick) in (State.QUEUED, State.LEASED):
            size = 1 + b % 300
            if ledger.buffer.fits(size):
                lease = ledger.leases.of_key(pick)
                ledger.accept(group(pick, size, min_version=max(0, version - b % 3), worker=f"w{b % 2}"),
                              lease.lease_id if lease and a % 2 else "other")
            else:
                with pytest.raises(ValueError):
                    ledger.accept(group(pick, size), "x")
        elif event == "serve":
            batches += 1
            served = ledger.serve(1 + b % 3, f"b{batches}")
            assert served is None or all(ledger.state(g.key) is State.TRAINING for g in served)
        elif event == "unserve" and ledger.batch_ids():
            ledger.unserve(ledger.batch_ids()[a % len(ledger.batch_ids())])
        elif event == "settle" and ledger.batch_ids():
            batch_id = ledger.batch_ids()[a % len(ledger.batch_ids())]
            ids = [g.group_id for g in ledger.buffer.batch(batch_id)]
            listed = {i for n, i in enumerate(ids) if (b >> n) & 1}
            for g, done in ledger.settle(batch_id, listed, set(ids[:1]) - listed):
                if done:
                    assert g.key not in trained, "a prompt was trained twice"
                    trained.add(g.key)
        elif event == "mark_trained" and pick is not None:
            assert ledger.mark_trained(pick)
            assert pick not in trained
            trained.add(pick)
        elif event == "stale":
            version += 1
            ledger.drop_stale(version, b % 3)
        elif event == "quarantine":
            ledger.drop_from(f"w{b % 2}", "s")
        elif event == "roll_back" and trained:
            key = sorted(trained)[a % len(trained)]
            assert ledger.roll_back(key)
            trained.discard(key)
        elif event == "restart":
            source = ledger.source
            before = set(ledger.pending_keys())
            ledger = GroupLedger.restored(
                lambda **kw: PromptSource(ListTask(epoch_size), num_epochs=num_epochs, reserve_block=4, **kw),
                cursor=source.cursor, reserved_until=source.reserved_until, pending=sorted(before),
                num_epochs=num_epochs,
                buffer=RolloutBuffer(max_groups=max_groups, max_bytes=max_bytes, group_overhead_bytes=10),
                leases=LeaseTable(timeout_s=5, max_per_worker=100, secret=b"k"))
            assert all(ledger.state(k) is State.QUEUED for k in before), "a pending prompt was lost in a restart"
        ledger.check()
        assert all(ledger.state(k) is State.TRAINED for k in trained), "a trained prompt came back"
        states = Counter(ledger.state(k) for k in ledger.pending_keys())
        assert states[State.LEASED] == ledger.num_leased and states[State.QUEUED] == ledger.num_queued
        assert states[State.BUFFERED] + states[State.TRAINING] == ledger.num_held <= max_groups
