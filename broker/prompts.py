"""Where every issued prompt is: the dataset cursor, the queue of prompts to hand out again, every prompt's
state (:class:`PromptSource`), and who holds each leased one until when (:class:`LeaseTable`). Both are
stores of the group ledger (:mod:`loraflow.broker.ledger`), its only writer.

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

The lease table. A lease gives one prompt (x group_size samples) to one worker with a deadline
(``broker.lease_timeout_s`` from the grant). The holder's heartbeats name the leases it is still working on and each pushes their
deadlines back to ``lease_timeout_s`` from then (:meth:`LeaseTable.renew`), so a generation that takes longer
than the timeout is not handed out a second time, while a dead or silent worker's leases still come back
within ``lease_timeout_s`` of its last heartbeat. A lease ends in one of four ways, each a ledger transition:

- the worker submits the group (:meth:`LeaseTable.pop`), or gives it back with a LeaseReturn;
- the deadline passes (:meth:`LeaseTable.expired`, the prompt is re-queued);
- the worker dies or re-registers with a new session (:meth:`LeaseTable.reclaim`, re-queued at once);
- a group for the same prompt arrives from an older, expired lease (:meth:`LeaseTable.cancel_key`): the
  late group is accepted, and the newer lease's later submit becomes a duplicate.

At most one lease exists per prompt, and a worker holds at most ``max_per_worker`` at once.

A lease is bound to its holder: its id ends in a MAC (HMAC-SHA256 under the run's ``secret``, kept in the
broker's state file) over the id, the prompt and the holder's identity, so :meth:`LeaseTable.issued_to` can
tell, also after the lease ended and after a broker restart, whether a lease id was really granted to this
client for this prompt: a client cannot submit for another client's lease or for a made-up lease id.

Pure logic: no sockets, no clock of its own (callers pass ``now_s``, a ``time.monotonic()`` reading).
"""

from __future__ import annotations

import heapq
import hmac
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from loraflow.broker.peers import display_name
from loraflow.common.task_base import Task, TaskItem

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


@dataclass(slots=True, kw_only=True)
class Lease:
    lease_id: str
    key: PromptKey
    worker: bytes  # the holder's zmq identity
    granted_s: float
    deadline_s: float


class LeaseTable:
    """Leases by id, by prompt and by worker, with deadlines kept in a heap."""

    def __init__(self, *, timeout_s: float, max_per_worker: int, id_prefix: str = "L", secret: bytes = b"") -> None:
        if timeout_s <= 0 or max_per_worker < 1:
            raise ValueError(f"lease timeout_s must be > 0 and max_per_worker >= 1, got {timeout_s}, {max_per_worker}")
        self.timeout_s = timeout_s
        self.max_per_worker = max_per_worker
        self._prefix = id_prefix
        self._secret = secret
        self._ids = itertools.count(1)
        self._by_id: dict[str, Lease] = {}
        self._by_key: dict[PromptKey, str] = {}
        self._by_worker: dict[bytes, set[str]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self.num_granted = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._by_id

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_id.values()))

    def get(self, lease_id: str) -> Lease | None:
        return self._by_id.get(lease_id)

    def of_key(self, key: PromptKey) -> Lease | None:
        lease_id = self._by_key.get(key)
        return None if lease_id is None else self._by_id[lease_id]

    def count(self, worker: bytes) -> int:
        return len(self._by_worker.get(worker, ()))

    def room(self, worker: bytes) -> int:
        """Leases this worker may still take."""
        return max(0, self.max_per_worker - self.count(worker))

    def of_worker(self, worker: bytes) -> list[Lease]:
        return [self._by_id[i] for i in sorted(self._by_worker.get(worker, ()))]

    def grant(self, key: PromptKey, worker: bytes, now_s: float) -> Lease:
        assert key not in self._by_key, f"prompt {key} is already leased"
        assert self.room(worker) > 0, "per-worker lease limit"
        serial = f"{self._prefix}{next(self._ids)}"
        lease = Lease(lease_id=f"{serial}.{self._mac(serial, key, worker)}", key=key, worker=worker,
                      granted_s=now_s, deadline_s=now_s + self.timeout_s)
        self._by_id[lease.lease_id] = lease
        self._by_key[key] = lease.lease_id
        self._by_worker.setdefault(worker, set()).add(lease.lease_id)
        heapq.heappush(self._deadlines, (lease.deadline_s, lease.lease_id))
        self.num_granted += 1
        return lease

    def _mac(self, serial: str, key: PromptKey, worker: bytes) -> str:
        message = b"%s|%d:%d|%s" % (serial.encode(), key[0], key[1], worker)
        return hmac.digest(self._secret, message, "sha256").hex()[:24]  # (one-shot: OpenSSL's fast path)

    def issued_to(self, lease_id: str, key: PromptKey, worker: bytes) -> bool:
        """Whether ``lease_id`` was granted to ``worker`` for ``key`` (live or ended, by this run's secret)."""
        serial, _, mac = lease_id.rpartition(".")
        return bool(serial) and hmac.compare_digest(mac.encode(), self._mac(serial, key, worker).encode())

    def pop(self, lease_id: str) -> Lease | None:
        """Remove a lease (submitted, returned, undeliverable); None if unknown."""
        lease = self._by_id.pop(lease_id, None)
        if lease is None:
            return None
        del self._by_key[lease.key]
        held = self._by_worker[lease.worker]
        held.discard(lease_id)
        if not held:
            del self._by_worker[lease.worker]
        return lease

    def renew(self, worker: bytes, lease_ids: list[str], now_s: float) -> int:
        """Push back to ``now_s + timeout_s`` the deadline of each listed lease that ``worker`` holds (ids of other
        holders, ended or made-up leases are ignored); returns how many were renewed."""
        held = self._by_worker.get(worker)
        if not held:
            return 0
        deadline_s = now_s + self.timeout_s
        renewed = 0
        for lease_id in set(lease_ids) & held:
            lease = self._by_id[lease_id]
            if deadline_s > lease.deadline_s:
                lease.deadline_s = deadline_s
                heapq.heappush(self._deadlines, (deadline_s, lease_id))  # the older entry is skipped by expired()
                renewed += 1
        return renewed

    def cancel_key(self, key: PromptKey) -> Lease | None:
        """Remove whatever lease is on this prompt (a group for it arrived by another route)."""
        lease_id = self._by_key.get(key)
        return None if lease_id is None else self.pop(lease_id)

    def expired(self, now_s: float) -> list[Lease]:
        """Remove and return the leases whose deadline has passed."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._by_id.get(lease_id)
            if lease is not None and lease.deadline_s <= now_s:
                out.append(self.pop(lease_id))
        if len(self._deadlines) > 4 * len(self._by_id) + 64:  # drop entries of leases that ended early
            self._deadlines = [(d, i) for d, i in self._deadlines if i in self._by_id]
            heapq.heapify(self._deadlines)
        return out

    def reclaim(self, worker: bytes) -> list[Lease]:
        """Remove and return every lease a worker holds (it died or restarted)."""
        return [lease for lease in (self.pop(i) for i in sorted(self._by_worker.get(worker, ()))) if lease]

    def next_deadline_s(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._by_id:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def snapshot(self, now_s: float) -> list[dict]:
        return [{"lease_id": lease.lease_id, "group_id": f"{lease.key[0]}:{lease.key[1]}",
                 "worker": display_name(lease.worker), "age_s": round(now_s - lease.granted_s, 3),
                 "expires_in_s": round(lease.deadline_s - now_s, 3)} for lease in self._by_id.values()]
