"""The rollout buffer: bounds in groups and bytes, oldest-first serving, acks, restores, stale drops."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.broker.buffer import RolloutBuffer, StoredGroup


def group(index: int, num_bytes: int = 100, min_version: int = 0) -> StoredGroup:
    return StoredGroup(group_id=f"0:{index}", key=(0, index), header={"group_id": f"0:{index}"}, wire_specs=[],
                       frames=[bytes(num_bytes)], num_bytes=num_bytes, min_version=min_version)


@pytest.mark.parametrize("held, new, max_groups, max_bytes, fits", [
    ([], 10_000, 2, 1000, True),  # one group always fits an empty buffer
    ([100], 100, 2, 1000, True),
    ([100, 100], 100, 2, 1000, False),  # group bound
    ([600], 400, 5, 1000, True),  # exactly at the byte bound
    ([600], 401, 5, 1000, False),  # byte bound
])
def test_fits(held: list[int], new: int, max_groups: int, max_bytes: int, fits: bool) -> None:
    buffer = RolloutBuffer(max_groups=max_groups, max_bytes=max_bytes, group_overhead_bytes=0)
    for i, size in enumerate(held):
        buffer.add(group(i, size))
    assert buffer.fits(new) is fits
    if not fits:
        with pytest.raises(ValueError, match="does not fit"):
            buffer.add(group(99, new))


def test_per_group_overhead_counts_against_the_bound() -> None:
    buffer = RolloutBuffer(max_groups=100, max_bytes=1000, group_overhead_bytes=200)
    buffer.add(group(0, 100))
    assert buffer.memory_bytes == 300 and buffer.num_bytes == 100
    assert buffer.fits(500) and not buffer.fits(501)  # 300 + 500 + 200 = 1000


def test_serve_oldest_first_and_ack_frees() -> None:
    buffer = RolloutBuffer(max_groups=10, max_bytes=10_000, group_overhead_bytes=0)
    for i in range(5):
        buffer.add(group(i, 100 + i))
    assert buffer.serve(6, "b1") is None
    served = buffer.serve(3, "b1")
    assert [g.group_id for g in served] == ["0:0", "0:1", "0:2"]
    assert buffer.state_of("0:1") == "training" and buffer.state_of("0:4") == "buffered"
    assert (buffer.num_buffered, buffer.num_training, buffer.num_bytes) == (2, 3, 510)
    assert (buffer.buffered_bytes, buffer.training_bytes) == (207, 303)
    assert buffer.ack("nope") is None
    assert [g.group_id for g in buffer.ack("b1")] == ["0:0", "0:1", "0:2"]
    assert (buffer.num_groups, buffer.num_bytes) == (2, 207)
    assert buffer.state_of("0:1") is None


def test_unserve_puts_groups_back_in_arrival_order() -> None:
    buffer = RolloutBuffer(max_groups=10, max_bytes=10_000, group_overhead_bytes=0)
    for i in range(4):
        buffer.add(group(i))
    buffer.serve(2, "b1")
    buffer.add(group(9))
    buffer.serve(2, "b2")
    assert [g.group_id for g in buffer.unserve("b2")] == ["0:2", "0:3"]
    assert [g.group_id for g in buffer.unserve("b1")] == ["0:0", "0:1"]
    assert [g.group_id for g in buffer.buffered()] == ["0:0", "0:1", "0:2", "0:3", "0:9"]
    assert buffer.batch_ids() == [] and buffer.training_bytes == 0 and buffer.buffered_bytes == 500


def test_discard_anywhere() -> None:
    buffer = RolloutBuffer(max_groups=10, max_bytes=10_000, group_overhead_bytes=0)
    for i in range(3):
        buffer.add(group(i))
    buffer.serve(2, "b1")
    assert buffer.discard("0:1").group_id == "0:1"
    assert [g.group_id for g in buffer.batch("b1")] == ["0:0"]
    assert buffer.discard("0:2").group_id == "0:2"
    assert buffer.discard("0:0").group_id == "0:0"
    assert buffer.batch_ids() == [] and buffer.num_bytes == 0 and buffer.discard("0:0") is None


def test_drop_stale_only_buffered() -> None:
    buffer = RolloutBuffer(max_groups=10, max_bytes=10_000, group_overhead_bytes=0)
    for i, version in enumerate([0, 3, 1, 4, 2]):
        buffer.add(group(i, min_version=version))
    buffer.serve(1, "b1")  # 0:0 (version 0) is training: the learner's to judge
    assert buffer.staleness_histogram(4) == {0: 1, 1: 1, 2: 1, 3: 1}
    dropped = buffer.drop_stale(latest_version=4, max_staleness=2)
    assert [g.group_id for g in dropped] == ["0:2"]
    assert [g.group_id for g in buffer.buffered()] == ["0:1", "0:3", "0:4"]
    assert buffer.num_training == 1


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "serve", "ack", "unserve", "discard", "stale"]),
                              st.integers(1, 400), st.integers(0, 6)), max_size=80))
def test_bounds_and_accounting_hold(ops: list) -> None:
    buffer = RolloutBuffer(max_groups=6, max_bytes=1000, group_overhead_bytes=50)
    next_index, version, batches = 0, 0, 0
    for op, size, pick in ops:
        if op == "add":
            fits = buffer.fits(size)
            if fits:
                buffer.add(group(next_index, size, min_version=version))
                next_index += 1
        elif op == "serve":
            batches += 1
            buffer.serve(pick % 3 + 1, f"b{batches}")
        elif op in ("ack", "unserve") and buffer.batch_ids():
            batch_id = buffer.batch_ids()[pick % len(buffer.batch_ids())]
            if op == "ack":
                buffer.ack(batch_id)
            else:  # groups back from training may have aged meanwhile: the broker drops them before serving
                buffer.unserve(batch_id)
                buffer.drop_stale(version, 2)
        elif op == "discard":
            buffer.discard(f"0:{pick}")
        elif op == "stale":
            version += 1
            buffer.drop_stale(version, 2)
        held = buffer.buffered() + [g for b in buffer.batch_ids() for g in buffer.batch(b)]
        assert buffer.num_groups == len(held) == len({g.group_id for g in held})
        assert buffer.num_bytes == sum(g.num_bytes for g in held)
        assert buffer.num_groups <= 6
        assert buffer.memory_bytes == buffer.num_bytes + 50 * buffer.num_groups
        assert buffer.memory_bytes <= 1000 or buffer.num_groups == 1
        ids = [int(g.group_id[2:]) for g in buffer.buffered()]
        assert all(g.min_version >= version - 2 for g in buffer.buffered())
        assert ids == sorted(ids), "buffered groups must stay in arrival order (oldest first)"
