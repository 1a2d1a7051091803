"""The outbox: replies now, after a durable write (released by sequence number), batched acks, undo, drain."""

from __future__ import annotations

from loraflow.broker.outbox import Outbox
from loraflow.broker.stats import BrokerStats
from loraflow.common import codec, protocol
from loraflow.common.protocol import AdapterAck, BatchSettled, Heartbeat, Kind

A, B = b"worker/a", b"learner/b"


def kinds(out: list) -> list[tuple[bytes, int]]:
    return [(o.identity, o.kind) for o in out]


def test_now_and_after_durable_replies_leave_in_order_of_their_writes() -> None:
    stats = BrokerStats()
    box = Outbox(stats)
    box.send_record(A, Heartbeat())
    box.send_record(B, BatchSettled(ref_id="b1"), after_durable=True)
    assert box.needs_write and box.has_ready(0)
    assert kinds(box.take()) == [(A, Kind.HEARTBEAT)]  # the ack waits for a write
    box.written(1)
    assert not box.needs_write and box.num_awaiting == 1
    box.send_record(B, BatchSettled(ref_id="b2"), after_durable=True)
    box.written(2)
    box.release(0)
    assert box.take() == [] and not box.has_ready(0)
    box.release(1)
    assert [codec.decode(o.frames)[0].ref_id for o in box.take()] == ["b1"]
    box.release(5)
    assert [codec.decode(o.frames)[0].ref_id for o in box.take()] == ["b2"]
    assert box.num_awaiting == 0
    assert stats.family("messages_out") == {"ack": 2, "heartbeat": 1}
    assert stats.bytes_out > 0


def test_without_a_state_file_written_lets_them_out_at_once() -> None:
    box = Outbox(BrokerStats())
    box.send_record(B, AdapterAck(version=3), after_durable=True)
    box.written(None)
    assert kinds(box.take()) == [(B, Kind.ACK)] and box.num_awaiting == 0


def test_batched_acks_one_per_client_and_status_in_chunks() -> None:
    box = Outbox(BrokerStats())
    for i in range(3):
        box.ack_group(A, "accepted", f"0:{i}")
    box.ack_group(A, "duplicate", "0:0")
    many = [f"1:{i}" for i in range(protocol.MAX_BATCH_GROUPS + 5)]
    for group_id in many:
        box.ack_group(B, "accepted", group_id)
    acks = [codec.decode(o.frames)[0] for o in box.take()]
    assert [(a.status, a.ids) for a in acks[:2]] == [("accepted", ["0:0", "0:1", "0:2"]), ("duplicate", ["0:0"])]
    assert [len(a.ids) for a in acks[2:]] == [protocol.MAX_BATCH_GROUPS + 1, 4]
    assert [i for a in acks[2:] for i in a.ids] == many
    assert box.take() == []


def test_a_refused_send_runs_its_undo_once_it_fails() -> None:
    box = Outbox(BrokerStats())
    undone = []
    box.send_record(A, Heartbeat(), on_fail=lambda: undone.append("lease back"))
    box.send_record(A, Heartbeat())
    first, second = box.take()
    assert box.failed(first) and undone == ["lease back"]
    assert not box.failed(second)


def test_drain_hands_out_everything_written_or_not() -> None:
    box = Outbox(BrokerStats())
    box.send_record(B, BatchSettled(ref_id="b1"), after_durable=True)
    box.written(7)
    box.send_record(B, BatchSettled(ref_id="b2"), after_durable=True)
    box.ack_group(A, "accepted", "0:1")
    box.send_record(A, Heartbeat())
    out = box.drain()
    assert kinds(out) == [(A, Kind.HEARTBEAT), (A, Kind.ACK), (B, Kind.ACK), (B, Kind.ACK)]
    assert not box.needs_write and box.num_awaiting == 0 and not box.has_ready(0)
