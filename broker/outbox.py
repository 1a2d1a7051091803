"""The replies the broker owes: every reply's life, from the handler that makes it to the socket that takes
it, and the long-polls parked until a reply can be made.

A reply goes one of three ways::

    send(...)                     -> ready ------------------------------------+
    send(..., after_durable=True) -> needs_write --written(seq)--> awaiting seq  |--take()--> server sends it
                                                   --release(durable seq)------+        |
    ack_group(client, status, id) -> gathered for this loop pass --take(): one Ack per |
                                     (client, status), MAX_BATCH_GROUPS + 1 ids each--+        v
                                                                        zmq refuses it: failed(out) runs its undo

- *now*: Welcome, Heartbeat, LeaseGrant, Batch, Error, Stats, AdapterUpdate (fetched) go out in the same loop
  pass.
- *after the state is durable*: an Ack of a BatchAck or an AdapterUpdate, and the Welcome of a restarted
  learner, promise something the state file must hold first. :attr:`Outbox.needs_write` tells the core to
  submit a state write; :meth:`Outbox.written` files the waiting replies under that write's sequence number;
  :meth:`Outbox.release` lets out every reply whose write is on disk (the writer's ``durable_seq``). One write
  covers every reply that waited for it (group commit).
- *batched acks*: a worker that reads ``Ack.ref_ids`` gets one Ack per status for all its groups of a loop
  pass.
- *refusals*: :meth:`Outbox.reject` counts ``rejected{reason}`` and sends the Error (never to an Error).
- *undo*: an :class:`Outgoing` may carry ``on_fail``, what to take back when zmq refuses it (the peer is gone or
  its queue is full): leases re-queued, a batch back to the buffer.

Parked long-polls. A LeaseRequest or BatchRequest that cannot be answered at once is parked as a
:class:`Waiter`. :class:`WaiterQueue` keeps them in arrival order with **at most one per client identity**: a client that asks
again replaces its parked request (the newer one carries the client's current wants; the older one is dropped
unanswered, which is what the clients expect: the worker's session treats a request as void once it asks
again). So the queue never holds more waiters than registered clients, however many requests one client sends.

Deadlines are kept in a heap with lazy deletion, so expiring ``k`` waiters out of ``n`` costs O(k log n).
Each desk owns its queue (:mod:`loraflow.broker.leasing`, :mod:`loraflow.broker.batching`).

Pure logic: no sockets; callers pass ``now_s`` (``time.monotonic()``). :class:`Outbox` counts
``messages_out`` and ``bytes_out`` as replies are made.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loraflow.broker.dispatch import KIND_NAMES
from loraflow.broker.peers import display_name
from loraflow.broker.stats import BrokerStats
from loraflow.common import codec, protocol
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Kind

log = get_logger("broker")


@dataclass(slots=True)
class Outgoing:
    identity: bytes
    frames: list[Any]
    kind: int
    on_fail: Callable[[], None] | None = None


class Outbox:
    """Replies ready to send, waiting for a state write, or gathered into batched acks (see the module docstring)."""

    def __init__(self, stats: BrokerStats) -> None:
        self._stats = stats
        self._ready: list[Outgoing] = []
        self._unsubmitted: list[Outgoing] = []  # need the next state write
        self._awaiting: deque[tuple[int, list[Outgoing]]] = deque()  # (write seq, replies), oldest first
        self.group_acks: dict[tuple[bytes, str], list[str]] = {}  # (client, status) -> group ids

    def send(self, identity: bytes, kind: int, frames: list[Any], *, on_fail: Callable[[], None] | None = None,
             after_durable: bool = False, num_bytes: int | None = None) -> None:
        (self._unsubmitted if after_durable else self._ready).append(Outgoing(identity, frames, kind, on_fail))
        self._stats.count("messages_out", KIND_NAMES[kind])
        self._stats.bytes_out += sum(len(f) for f in frames) if num_bytes is None else num_bytes

    def send_to_all(self, identities: list[bytes], kind: int, frames: list[Any]) -> None:
        """The same frames to every identity (a publish's notices), counted once: at 4,096 workers a send()
        each cost ~3 ms of the loop pass."""
        self._ready.extend([Outgoing(identity, frames, kind) for identity in identities])
        self._stats.count("messages_out", KIND_NAMES[kind], len(identities))
        self._stats.bytes_out += sum(len(f) for f in frames) * len(identities)

    def send_record(self, identity: bytes, record: Any, *, on_fail: Callable[[], None] | None = None,
                    after_durable: bool = False) -> None:
        self.send(identity, int(record.KIND), codec.encode(record), on_fail=on_fail, after_durable=after_durable)

    def reject(self, identity: bytes, code: str, message: str, *, ref_kind: int = 0, ref_id: str = "",
               ref_version: int = 0, reason: str | None = None) -> None:
        """An Error reply, counted as ``rejected{reason or code}``; an Error is never answered with one."""
        self._stats.count("rejected", reason or code)
        log.debug("rejected", peer=display_name(identity)[:64], code=code, error=message[:300])
        if ref_kind != Kind.ERROR:
            self.send_record(identity, protocol.Error(code=code, message=message[:4000], ref_kind=ref_kind,
                                                      ref_id=ref_id[:protocol.MAX_ID_LEN], ref_version=ref_version))

    def ack_group(self, identity: bytes, status: str, group_id: str) -> None:
        """Acknowledge a group with the others of this loop pass (one Ack per client and status)."""
        self.group_acks.setdefault((identity, status), []).append(group_id)

    # -- durability ------------------------------------------------------------------------------------------

    @property
    def needs_write(self) -> bool:
        """Replies wait for a state write that has not been submitted yet."""
        return bool(self._unsubmitted)

    def written(self, seq: int | None) -> None:
        """The state is submitted as write ``seq``: the replies that needed it wait for it (None: no state file,
        they go out now)."""
        replies, self._unsubmitted = self._unsubmitted, []
        if seq is None:
            self._ready.extend(replies)
        elif replies:
            self._awaiting.append((seq, replies))

    def release(self, durable_seq: int) -> None:
        """Let out the replies whose write is on disk."""
        while self._awaiting and self._awaiting[0][0] <= durable_seq:
            self._ready.extend(self._awaiting.popleft()[1])

    @property
    def num_awaiting(self) -> int:
        """Writes that replies still wait for."""
        return len(self._awaiting)

    def has_ready(self, durable_seq: int) -> bool:
        """Something to send, or to write first, without waiting for a message."""
        return bool(self._ready or self._unsubmitted or self.group_acks
                    or (self._awaiting and self._awaiting[0][0] <= durable_seq))

    # -- out -------------------------------------------------------------------------------------------------

    def _gather_acks(self) -> None:
        acks, self.group_acks = self.group_acks, {}
        step = protocol.MAX_BATCH_GROUPS + 1  # ref_id plus up to MAX_BATCH_GROUPS ref_ids
        for (identity, status), ids in acks.items():
            for start in range(0, len(ids), step):
                chunk = ids[start:start + step]
                self.send_record(identity, protocol.GroupAck(ref_id=chunk[0], status=status, ref_ids=chunk[1:] or None))

    def take(self) -> list[Outgoing]:
        """What to send now (the batched acks of this pass included)."""
        if self.group_acks:
            self._gather_acks()
        out, self._ready = self._ready, []
        return out

    def drain(self) -> list[Outgoing]:
        """Everything, written or not (shutting down: the caller has written the state synchronously)."""
        out = self.take()
        out.extend(self._unsubmitted)
        for _, replies in self._awaiting:
            out.extend(replies)
        self._unsubmitted, self._awaiting = [], deque()
        return out

    def failed(self, out: Outgoing) -> bool:
        """zmq refused ``out``: run its undo; True if it had one."""
        if out.on_fail is None:
            return False
        out.on_fail()
        return True


@dataclass(slots=True, kw_only=True)
class Waiter:
    """A parked long-poll: answered when state changes, or empty at its deadline."""

    identity: bytes
    request: Any  # LeaseRequest or BatchRequest
    deadline_s: float
    seq: int = field(default=0, compare=False)  # set by the queue: tells a heap entry of a replaced waiter


class WaiterQueue:
    """Parked requests by identity, in arrival order, with a deadline heap (see the module docstring)."""

    def __init__(self) -> None:
        self._by_identity: dict[bytes, Waiter] = {}  # insertion order = arrival order
        self._deadlines: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_identity)

    def __bool__(self) -> bool:
        return bool(self._by_identity)

    def __iter__(self) -> Iterator[Waiter]:
        """The waiters in arrival order (a copy: callers may remove while iterating)."""
        return iter(list(self._by_identity.values()))

    def park(self, waiter: Waiter) -> Waiter | None:
        """Park ``waiter``; returns the older waiter of the same identity it replaces, if any."""
        replaced = self._by_identity.pop(waiter.identity, None)
        waiter.seq = next(self._seq)
        self._by_identity[waiter.identity] = waiter
        heapq.heappush(self._deadlines, (waiter.deadline_s, waiter.seq, waiter.identity))
        self._compact()
        return replaced

    def remove(self, identity: bytes) -> Waiter | None:
        """Unpark the waiter of ``identity`` (answered, or its client is gone)."""
        return self._by_identity.pop(identity, None)

    def first(self) -> Waiter | None:
        return next(iter(self._by_identity.values()), None)

    def clear(self) -> None:
        self._by_identity.clear()
        self._deadlines.clear()

    def expired(self, now_s: float) -> list[Waiter]:
        """Unpark and return the waiters whose deadline has passed, earliest first."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, seq, identity = heapq.heappop(self._deadlines)
            waiter = self._by_identity.get(identity)
            if waiter is not None and waiter.seq == seq:
                del self._by_identity[identity]
                out.append(waiter)
        return out

    def next_deadline_s(self) -> float | None:
        while self._deadlines and not self._live(self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _live(self, entry: tuple[float, int, bytes]) -> bool:
        waiter = self._by_identity.get(entry[2])
        return waiter is not None and waiter.seq == entry[1]

    def _compact(self) -> None:
        """Drop heap entries of waiters answered or replaced early, once they outnumber the live ones."""
        if len(self._deadlines) > 4 * len(self._by_identity) + 64:
            self._deadlines = [e for e in self._deadlines if self._live(e)]
            heapq.heapify(self._deadlines)
