"""Random message sequences from two workers and a learner through an in-process core: whatever they send
(valid, invalid, for another's lease, duplicated, replayed, garbage), no handler fails in its apply half
(HalfApplied would propagate out of handle), and after every message the ledger's stores agree
(GroupLedger.check) and every prompt is trained at most once."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loraflow.common import codec
from loraflow.common.protocol import BatchAck, BatchRequest, Bye, Heartbeat, Kind, LeaseReturn, PolicyMismatch
from tests.broker.clients import make_group
from tests.broker.harness import LEARNER, W1, W2, Harness

OPS = ["lease", "lease", "submit", "submit", "resubmit", "submit_bad", "submit_theirs", "return", "batch", "ack",
       "ack_replay", "expire", "publish", "bye", "garbage"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(ops=[("lease", 0), ("expire", 5), ("submit_theirs", 1)])  # the clients outlive a lease timeout
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1 << 16)), min_size=1, max_size=40))
def test_no_message_sequence_breaks_the_ledger(ops: list[tuple[str, int]]) -> None:
    h = Harness("broker.capacity_groups=6", "run.max_staleness=2")
    for identity in (W1, W2, LEARNER):
        h.hello(identity)
    leases: dict[bytes, list] = {W1: [], W2: []}
    sent: dict[bytes, list] = {W1: [], W2: []}  # leases submitted once: sent again, a duplicate (or late)
    batches: list = []
    trained: set[str] = set()
    version = 0
    for op, pick in ops:
        worker = W1 if pick % 2 else W2
        mine = leases[worker]
        replies: list = []
        if op == "lease":
            mine.extend(h.lease(worker, 1 + pick % 3, adapter_version=version))
        elif op in ("submit", "submit_bad") and mine:
            lease = mine.pop(pick % len(mine))
            sent[worker].append(lease)
            bad = {"logprob": float("nan")} if op == "submit_bad" else {}
            record, tensors = make_group(lease, worker.decode(), version=version, **bad)
            replies = h.send(worker, record, tensors)
        elif op == "resubmit" and sent[worker]:
            record, tensors = make_group(sent[worker][pick % len(sent[worker])], worker.decode(), version=version)
            replies = h.send(worker, record, tensors)
        elif op == "submit_theirs" and leases[W1 if worker == W2 else W2]:
            theirs = leases[W1 if worker == W2 else W2][0]
            record, tensors = make_group(theirs, worker.decode(), version=version)
            replies = h.send(worker, record, tensors)
            assert any(r.KIND == Kind.ERROR and r.code == "unknown_lease" for i, r, _ in replies if i == worker)
        elif op == "return" and mine:
            replies = h.send(worker, LeaseReturn(lease_ids=[mine.pop().lease_id]))
        elif op == "batch":
            replies = h.send(LEARNER, BatchRequest(num_groups=1 + pick % 2, wait_ms=0))
            batches += [r for i, r, _ in replies if i == LEARNER and r.KIND == Kind.BATCH and r.batch_id]
        elif op in ("ack", "ack_replay") and batches:
            batch = batches[pick % len(batches)] if op == "ack_replay" else batches.pop(0)
            ids = [entry.group.group_id for entry in batch.groups]
            listed = [g for n, g in enumerate(ids) if (pick >> n) & 1]
            failed = [PolicyMismatch(group_id=g, reason="logprobs") for g in ids if g not in listed][:1]
            before = {g for g in ids if h.core.ledger.state(tuple(map(int, g.split(":")))) == "trained"}
            h.send(LEARNER, BatchAck(batch_id=batch.batch_id, step=1, trained_version=version, group_ids=listed,
                                     mismatches=failed))
            newly = {g for g in listed if g not in before}
            assert not (newly & trained), "a prompt was trained twice"
            trained |= newly
        elif op == "expire":  # leases may expire; the clients heartbeat meanwhile, so none of them dies
            for _ in range(1 + pick % 12):
                h.now += 1
                for identity in (W1, W2, LEARNER):
                    h.core.handle(identity, codec.encode(Heartbeat()), h.now)
                h.flush()
        elif op == "publish":
            version += 1
            h.publish(version)
        elif op == "bye":
            h.send(worker, Bye(reason="test"))
            leases[worker], sent[worker] = [], []
            h.hello(worker, adapter_version=version, session=f"s{pick}")
        elif op == "garbage":
            frames = codec.encode(Bye(reason="x"))
            h.send_frames(worker, [frames[0], bytes([pick % 256]) * (pick % 7)])
        h.core.ledger.check()
        assert all(i in (W1, W2, LEARNER) for i, _, _ in replies)
        for group_id in trained:
            state = h.core.ledger.state(tuple(map(int, group_id.split(":"))))
            assert state == "trained", f"{group_id} was trained, now {state}"
