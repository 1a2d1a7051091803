"""The prompt source: the dataset cursor, the queue of prompts to hand out again, and every prompt's state.

A prompt is identified by its key ``(epoch, index)``; its ``group_id`` is ``"epoch:index"``, the dedup key of
the rollout group generated for it. The cursor is the next key never handed out. Every key below the cursor
is either *pending* (one of the states below, held in :attr:`PromptSource.states`) or *trained*: trained
keys are simply the issued keys that are no longer pending, so the set of trained prompts costs no memory::

    new (>= cursor) --next()--> leased --group accepted--> buffered --served--> training --acked--> trained
                                  ^  |                        |                    |
                                  |  +-- expired/returned/   |  stale/rejected    |  learner died
                                  |      rejected            v                    v
                                queued <------------------ requeue()  (training -> buffered is the buffer's job)

Re-queued prompts are handed out before new ones, oldest key first. An epoch holds ``task.size`` prompts
(JSONL tasks), or ``broker.prompt_limit`` for generated tasks (0 = one endless epoch); after
``broker.num_epochs`` epochs (0 = forever) no new prompts are issued.

Persistence hook: new keys are only issued inside a *reserved block* ``[cursor, reserved_until)``. When the
cursor reaches the end of the block, :class:`PromptSource` calls ``on_reserve(new_end)`` *before* issuing
the key, so that the broker's state file always covers every key that may have been handed out
(see :mod:`loraflow.broker.state`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable

from loraflow.common.tasks import Task, TaskItem

PromptKey = tuple[int, int]

#: states of an issued, not yet trained prompt
PENDING_STATES = ("queued", "leased", "buffered", "training")


def group_id_of(key: PromptKey) -> str:
    return f"{key[0]}:{key[1]}"


def parse_group_id(group_id: str) -> PromptKey | None:
    """The key of a ``"epoch:index"`` group id, or None when it is not one. Only the canonical spelling counts
    (ASCII digits, no leading zeros): "0:03" must not name the prompt whose group is held as "0:3"."""
    epoch, sep, index = group_id.partition(":")
    if not sep or len(group_id) > 40 or not (epoch + index).isascii() or not epoch.isdigit() or not index.isdigit():
        return None
    key = int(epoch), int(index)
    return key if group_id_of(key) == group_id else None


class PromptSource:
    """Cursor, re-queue and prompt states over a task's train split."""

    def __init__(self, task: Task, *, prompt_limit: int = 0, num_epochs: int = 0, reserve_block: int = 256,
                 cursor: PromptKey = (0, 0), requeued: Iterable[PromptKey] = (),
                 on_reserve: Callable[[PromptKey], None] | None = None) -> None:
        if reserve_block < 1:
            raise ValueError(f"reserve_block must be >= 1, got {reserve_block}")
        self.task = task
        self.epoch_size: int | None = task.size if task.size is not None else (prompt_limit or None)
        self.num_epochs = num_epochs
        self.reserve_block = reserve_block
        self.cursor: PromptKey = cursor
        self.reserved_until: PromptKey = cursor
        self.on_reserve = on_reserve
        self.states: dict[PromptKey, str] = {}
        self.counts: Counter[str] = Counter()
        self._queue: list[PromptKey] = []  # heap of queued keys (lazy: a popped key may no longer be queued)
        for key in requeued:
            if not self.is_valid(key):
                raise ValueError(f"persisted prompt {group_id_of(key)} does not fit the task ({self.describe()}); "
                                 "was the state file written for another run.task / broker.prompt_limit?")
            if key >= self.cursor:
                raise ValueError(f"persisted prompt {group_id_of(key)} is at or past the cursor {self.cursor}")
            self.requeue(key)

    # -- keys ------------------------------------------------------------------------------------------------

    def describe(self) -> str:
        size = "unbounded" if self.epoch_size is None else str(self.epoch_size)
        return f"task {self.task.name}, {size} prompts per epoch, num_epochs {self.num_epochs or 'unbounded'}"

    def is_valid(self, key: PromptKey) -> bool:
        epoch, index = key
        return epoch >= 0 and index >= 0 and (self.epoch_size is None or index < self.epoch_size)

    def advance(self, key: PromptKey, steps: int = 1) -> PromptKey:
        """The key ``steps`` after ``key`` in issue order (epochs wrap at epoch_size)."""
        epoch, index = key[0], key[1] + steps
        if self.epoch_size is not None:
            epoch, index = epoch + index // self.epoch_size, index % self.epoch_size
        return epoch, index

    def keys_between(self, start: PromptKey, end: PromptKey) -> list[PromptKey]:
        """Keys in issue order from ``start`` (inclusive) to ``end`` (exclusive)."""
        out = []
        key = start
        while key < end:
            out.append(key)
            key = self.advance(key)
        return out

    def exhausted(self) -> bool:
        """True when num_epochs are all issued (no new keys; re-queued ones may remain)."""
        return self.num_epochs > 0 and self.cursor[0] >= self.num_epochs

    def state(self, key: PromptKey) -> str:
        """"new", one of PENDING_STATES, or "trained"."""
        if key >= self.cursor or not self.is_valid(key):
            return "new"
        return self.states.get(key, "trained")

    def item(self, key: PromptKey) -> TaskItem:
        return self.task.item(key[1], "train")

    # -- issuing ---------------------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return self.counts["queued"]

    def available(self, limit: int) -> int:
        """How many prompts next() could hand out now, counting at most ``limit``."""
        count = self.num_queued
        if count >= limit or self.exhausted():
            return min(count, limit)
        if self.epoch_size is None or self.num_epochs == 0:
            return limit
        remaining_new = (self.num_epochs - self.cursor[0]) * self.epoch_size - self.cursor[1]
        return min(limit, count + remaining_new)

    def next(self) -> PromptKey | None:
        """The next prompt to lease (re-queued first, oldest key first), now in state "leased"; None if none."""
        while self._queue:
            key = heapq.heappop(self._queue)
            if self.states.get(key) == "queued":
                self._set(key, "leased")
                return key
        if self.exhausted():
            return None
        key = self.cursor
        if key >= self.reserved_until:
            end = self.advance(key, self.reserve_block)
            if self.num_epochs and self.epoch_size is not None:
                end = min(end, (self.num_epochs, 0))  # never reserve past the last epoch
            self.reserved_until = end
            if self.on_reserve is not None:
                self.on_reserve(self.reserved_until)
        self.cursor = self.advance(key)
        self._set(key, "leased")
        return key

    # -- state changes ---------------------------------------------------------------------------------------

    def _set(self, key: PromptKey, state: str) -> None:
        old = self.states.get(key)
        if old is not None:
            self.counts[old] -= 1
        self.states[key] = state
        self.counts[state] += 1

    def set_state(self, key: PromptKey, state: str) -> None:
        """Move an issued, pending prompt to another pending state (use requeue() for "queued")."""
        assert state in PENDING_STATES and state != "queued", state
        assert key in self.states, f"{group_id_of(key)} is not pending"
        self._set(key, state)

    def requeue(self, key: PromptKey) -> None:
        """Hand this prompt out again (before new ones)."""
        if self.states.get(key) == "queued":
            return
        self._set(key, "queued")
        heapq.heappush(self._queue, key)

    def mark_trained(self, key: PromptKey) -> bool:
        """The prompt is done for good; returns False if it was not pending."""
        old = self.states.pop(key, None)
        if old is None:
            return False
        self.counts[old] -= 1
        return True

    def pending_keys(self) -> list[PromptKey]:
        return sorted(self.states)

    def snapshot(self) -> dict[str, int]:
        return {"epoch": self.cursor[0], "index": self.cursor[1],
                **{state: self.counts[state] for state in PENDING_STATES}}
