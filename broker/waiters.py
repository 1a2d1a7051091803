"""Parked long-polls: requests the broker answers when state changes, or empty at their deadline.

A LeaseRequest or BatchRequest that cannot be answered at once is parked as a :class:`Waiter`.
:class:`WaiterQueue` keeps them in arrival order with **at most one per client identity**: a client that asks
again replaces its parked request (the newer one carries the client's current wants; the older one is dropped
unanswered, which is what the clients expect: the worker's session treats a request as void once it asks
again). So the queue never holds more waiters than registered clients, however many requests one client sends.

Deadlines are kept in a heap with lazy deletion, so expiring ``k`` waiters out of ``n`` costs
O(k log n) (it was a ``deque.remove`` per expired waiter: O(n) each, seconds of stalled loop for thousands).
Pure logic: no sockets; callers pass ``now_s`` (``time.monotonic()``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


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
