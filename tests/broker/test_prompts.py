"""The prompt source: cursor, epochs, re-queue order, states, the reserved block; plus a property test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.broker.prompts import PromptSource, group_id_of, parse_group_id
from loraflow.common.task_base import Task, TaskItem
from loraflow.common.tasks import ArithTask


class ListTask(Task):
    name = "list"

    def __init__(self, size: int) -> None:
        self.size = size

    def item(self, index: int, split: str = "train") -> TaskItem:
        return TaskItem(f"prompt {index}", str(index))


@pytest.mark.parametrize("text, key", [
    ("0:0", (0, 0)), ("3:17", (3, 17)), ("", None), ("1", None), ("a:1", None), ("1:-2", None),
    ("1:2:3", None), ("-1:2", None), (" 1:2", None), ("9" * 50 + ":1", None),
])
def test_parse_group_id(text: str, key: tuple[int, int] | None) -> None:
    assert parse_group_id(text) == key
    if key is not None:
        assert group_id_of(key) == text


@pytest.mark.parametrize("epoch_size, key, steps, expected", [
    (None, (0, 5), 1, (0, 6)),
    (None, (0, 5), 1000, (0, 1005)),
    (3, (0, 2), 1, (1, 0)),
    (3, (1, 1), 7, (3, 2)),
    (1, (4, 0), 2, (6, 0)),
])
def test_advance(epoch_size: int | None, key: tuple[int, int], steps: int, expected: tuple[int, int]) -> None:
    source = PromptSource(ListTask(epoch_size) if epoch_size else ArithTask())
    assert source.advance(key, steps) == expected


def test_epochs_end_after_num_epochs() -> None:
    source = PromptSource(ListTask(2), num_epochs=2)
    keys = [source.next() for _ in range(5)]
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 1), None]
    assert source.exhausted()
    assert source.available(10) == 0
    source.requeue((0, 1))
    assert source.available(10) == 1
    assert source.next() == (0, 1)


def test_prompt_limit_bounds_generated_tasks() -> None:
    source = PromptSource(ArithTask(), prompt_limit=3, num_epochs=1)
    keys = [source.next() for _ in range(4)]
    assert keys == [(0, 0), (0, 1), (0, 2), None]
    assert source.item((0, 2)) == ArithTask().item(2)


def test_requeued_first_oldest_first() -> None:
    source = PromptSource(ListTask(100))
    keys = [source.next() for _ in range(5)]
    for key in (keys[3], keys[1], keys[4]):
        source.requeue(key)
    assert [source.next() for _ in range(4)] == [(0, 1), (0, 3), (0, 4), (0, 5)]


def test_states_and_counts() -> None:
    source = PromptSource(ListTask(10))
    a, b = source.next(), source.next()
    assert source.state(a) == "leased" and source.state((0, 7)) == "new" and source.state((0, 99)) == "new"
    source.set_state(a, "buffered")
    source.set_state(a, "training")
    assert source.mark_trained(a)
    assert source.state(a) == "trained"
    assert not source.mark_trained(a)
    source.requeue(b)
    source.requeue(b)  # twice is once
    assert source.snapshot() == {"epoch": 0, "index": 2, "queued": 1, "leased": 0, "buffered": 0, "training": 0}
    assert source.pending_keys() == [b]


def test_reserve_is_called_before_a_key_past_the_block_is_issued() -> None:
    calls = []
    source = PromptSource(ListTask(5), reserve_block=3)
    source.on_reserve = lambda end: calls.append((end, source.cursor))
    for _ in range(7):
        key = source.next()
        assert key < calls[-1][0], "a key was issued outside the reserved block"
    # the callback sees the cursor still at the first key of the new block
    assert calls == [((0, 3), (0, 0)), ((1, 1), (0, 3)), ((1, 4), (1, 1))]


def test_restored_keys_must_fit() -> None:
    with pytest.raises(ValueError, match="does not fit the task"):
        PromptSource(ListTask(3), cursor=(1, 0), requeued=[(0, 5)])
    with pytest.raises(ValueError, match="past the cursor"):
        PromptSource(ListTask(3), cursor=(0, 1), requeued=[(0, 2)])


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["next", "requeue", "buffer", "train"]), st.integers(0, 50)),
                    max_size=120),
       epoch_size=st.sampled_from([None, 1, 4, 7]), num_epochs=st.sampled_from([0, 1, 3]))
def test_every_issued_prompt_is_pending_or_trained_exactly_once(ops: list, epoch_size: int | None,
                                                                num_epochs: int) -> None:
    task = ListTask(epoch_size) if epoch_size else ArithTask()
    source = PromptSource(task, num_epochs=num_epochs if epoch_size else 0, reserve_block=5)
    issued: list[tuple[int, int]] = []
    trained: set[tuple[int, int]] = set()
    for op, pick in ops:
        pending = source.pending_keys()
        if op == "next":
            key = source.next()
            if key is None:
                assert source.available(1) == 0
                continue
            assert key not in trained, "a trained prompt was issued again"
            assert key in issued or key == source.advance(issued[-1] if issued else (0, 0), 1 if issued else 0)
            if key not in issued:
                issued.append(key)
        elif pending:
            key = pending[pick % len(pending)]
            if op == "requeue":
                source.requeue(key)
            elif op == "buffer" and source.state(key) == "leased":
                source.set_state(key, "buffered")
            elif op == "train" and source.state(key) == "buffered":
                source.mark_trained(key)
                trained.add(key)
        states = {key: source.state(key) for key in issued}
        assert {k for k, s in states.items() if s == "trained"} == trained
        assert sorted(k for k, s in states.items() if s != "trained") == source.pending_keys()
        assert sum(source.counts.values()) == len(source.pending_keys())
        assert len(set(issued)) == len(issued)
        assert all(key < source.cursor for key in issued)
        assert source.cursor <= source.reserved_until
