"""AdapterNotices paced out in batches: a publish to a large fleet must not hold up the replies sent after it.

The zmq I/O thread writes queued messages in order, so a publish to 4,096 workers handed out at once (16 fast
loop passes) made any lease grant or ack sent meanwhile wait ~50-80 ms behind the notices
(bench/broker_scale.py: 77 % of the grants over 20 ms overlapped a publish). :class:`NoticePacer` owns the
notices not yet handed out: each pass's replies go first, then at most :data:`NOTICE_BATCH` notices, and after a
full batch the next waits :data:`NOTICE_SPACING_S`. The fan-out of 4,096 takes 4,096 / 128 x 5 ms = 160 ms and a
reply waits behind at most one batch; only a full batch makes the next wait, so up to 128 workers (and a late
joiner's single notice) get theirs at once. Each worker still gets its notices in order; a notice carries no
promise to undo (:mod:`loraflow.broker.outbox`), so holding one back is safe.
"""

from __future__ import annotations

from collections import deque

from loraflow.broker.outbox import Outgoing
from loraflow.common.protocol import Kind

NOTICE_BATCH = 128
NOTICE_SPACING_S = 0.005


class NoticePacer:
    """The AdapterNotices queued for a later batch, and when the next batch may go."""

    def __init__(self) -> None:
        self._queued: deque[Outgoing] = deque()
        self._next_s = 0.0

    def __len__(self) -> int:
        return len(self._queued)

    def due(self, now_s: float) -> bool:
        """Notices are queued and their next batch may go now."""
        return bool(self._queued) and now_s >= self._next_s

    def next_due_s(self) -> float | None:
        """When the next batch may go (None: nothing queued)."""
        return self._next_s if self._queued else None

    def spread(self, out: list[Outgoing], now_s: float) -> list[Outgoing]:
        """``out`` with its AdapterNotices queued behind earlier ones, and, when a batch is due, at most
        NOTICE_BATCH of those appended."""
        if not self._queued and not any(o.kind == Kind.ADAPTER_NOTICE for o in out):
            return out
        queued = self._queued
        kept = []
        for o in out:
            (queued.append if o.kind == Kind.ADAPTER_NOTICE else kept.append)(o)
        if now_s >= self._next_s:
            batch = min(NOTICE_BATCH, len(queued))
            kept.extend(queued.popleft() for _ in range(batch))
            # a full batch may have more behind it: the next waits; after a partial one the queue is short
            self._next_s = now_s + NOTICE_SPACING_S if batch == NOTICE_BATCH else now_s
        return kept

    def take_all(self) -> list[Outgoing]:
        """Every queued notice, now (shutting down: they are older than anything the outbox holds)."""
        pending = list(self._queued)
        self._queued.clear()
        return pending
