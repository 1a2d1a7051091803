"""The rollout buffer: accepted groups, held as received frames until the learner acknowledges them.

A group's *slot* lives from acceptance to the learner's BatchAck::

    add() --> buffered (oldest first) --serve()--> training (in batch B) --ack(B)--> freed
                 ^   |                                  |
                 |   +--drop_stale()--> dropped         |  unserve(B): the learner died or the send failed
                 |   +--drop_from()--> dropped          |  (back in arrival order, ahead of newer groups)
                 +--------------------------------------+

``drop_from`` takes out the buffered groups of one worker process, whose rollouts failed the learner's policy
check (:mod:`loraflow.broker.quarantine`): each group remembers who submitted it (``worker`` + ``session``).

Both buffered and training groups count against the two bounds, ``max_groups`` and ``max_bytes``: the bytes
stay referenced until the ack, because a learner that dies mid-step gets the same groups again.
:meth:`RolloutBuffer.fits` is the hard check at arrival; a group that does not fit is refused (one group
always fits an empty buffer, so an oversized group cannot wedge the run).

``max_bytes`` bounds memory, not just tensor bytes: each group is charged its frames plus
``GROUP_OVERHEAD_BYTES`` for what holding it costs besides (its decoded header, Python objects, and the
libzmq receive chunk its small frames keep alive). Measured with bench/broker_memory.py: about 20 KB per group
whatever its size, so a buffer of many small groups would otherwise overshoot its bound by several times.

Nothing here decodes or copies tensor bytes: a :class:`StoredGroup` keeps the received ``zmq.Frame`` objects
(any buffer-like works, which is what the unit tests use) and the group's decoded header fields, from which
the server builds Batch messages that forward the frames as they are. Pure logic: no sockets, no clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from loraflow.broker.prompts import PromptKey
from loraflow.common.versions import StalenessRule, group_is_too_stale

GROUP_OVERHEAD_BYTES = 24 << 10


@dataclass(slots=True, kw_only=True)
class StoredGroup:
    group_id: str
    key: PromptKey
    header: Any  # the decoded RolloutGroup record (loraflow.common.protocol), worker_id and worker_session as registered
    wire_specs: list[Any]  # the tensor specs as received (loraflow.common.framing.TensorSpec); "frame" indexes ``frames``
    frames: list[Any] = field(repr=False)  # the received tensor frames, untouched
    num_bytes: int  # all frames of the message, as counted on arrival
    min_version: int  # the oldest of its tokens' versions
    max_version: int = -1  # the newest (what the staleness rule keeps a group by); -1: the same as min_version
    num_tokens: int = 0
    worker: str = ""  # the client id of the worker process that submitted it, as registered (not as it claims)
    session: str = ""  # that process's session: (worker, session) is whom its policy check counts against
    received_s: float = 0.0
    seq: int = 0  # arrival order, set by RolloutBuffer.add

    def __post_init__(self) -> None:
        if self.max_version < self.min_version:
            self.max_version = self.min_version


class RolloutBuffer:
    """Buffered groups oldest-first, plus the served (training) ones by batch id; bounded in groups and bytes."""

    def __init__(self, *, max_groups: int, max_bytes: int, group_overhead_bytes: int = GROUP_OVERHEAD_BYTES) -> None:
        if max_groups < 1 or max_bytes < 1:
            raise ValueError(f"buffer bounds must be >= 1, got max_groups={max_groups} max_bytes={max_bytes}")
        self.max_groups = max_groups
        self.max_bytes = max_bytes
        self.group_overhead_bytes = group_overhead_bytes
        self._buffered: OrderedDict[str, StoredGroup] = OrderedDict()
        self._batches: dict[str, list[StoredGroup]] = {}
        self._batch_of: dict[str, str] = {}  # group id -> batch id, for training groups
        self.buffered_bytes = 0
        self.training_bytes = 0
        self._seq = 0

    # -- sizes -----------------------------------------------------------------------------------------------

    @property
    def num_buffered(self) -> int:
        return len(self._buffered)

    @property
    def num_training(self) -> int:
        return len(self._batch_of)

    @property
    def num_groups(self) -> int:
        return len(self._buffered) + len(self._batch_of)

    @property
    def num_bytes(self) -> int:
        return self.buffered_bytes + self.training_bytes

    @property
    def memory_bytes(self) -> int:
        """What the held groups are charged against max_bytes: their frames plus the per-group overhead."""
        return self.num_bytes + self.num_groups * self.group_overhead_bytes

    def fits(self, num_bytes: int) -> bool:
        """Whether a group of this size may be added now (always true for an empty buffer)."""
        if self.num_groups == 0:
            return True
        return (self.num_groups < self.max_groups
                and self.memory_bytes + num_bytes + self.group_overhead_bytes <= self.max_bytes)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._buffered or group_id in self._batch_of

    def state_of(self, group_id: str) -> str | None:
        """"buffered", "training" or None."""
        if group_id in self._buffered:
            return "buffered"
        return "training" if group_id in self._batch_of else None

    # -- transitions -----------------------------------------------------------------------------------------

    def add(self, group: StoredGroup) -> None:
        assert group.group_id not in self, f"group {group.group_id} is already held"
        if not self.fits(group.num_bytes):
            raise ValueError(f"group {group.group_id} ({group.num_bytes} bytes) does not fit the buffer "
                             f"({self.num_groups}/{self.max_groups} groups, {self.num_bytes}/{self.max_bytes} bytes)")
        self._seq += 1
        group.seq = self._seq
        self._buffered[group.group_id] = group
        self.buffered_bytes += group.num_bytes

    def serve(self, num_groups: int, batch_id: str) -> list[StoredGroup] | None:
        """The ``num_groups`` oldest buffered groups, now training in ``batch_id``; None if fewer are buffered."""
        if num_groups < 1 or len(self._buffered) < num_groups:
            return None
        assert batch_id not in self._batches, f"batch id {batch_id} reused"
        groups = [self._buffered.popitem(last=False)[1] for _ in range(num_groups)]
        self._batches[batch_id] = groups
        for group in groups:
            self._batch_of[group.group_id] = batch_id
            self.buffered_bytes -= group.num_bytes
            self.training_bytes += group.num_bytes
        return groups

    def batch(self, batch_id: str) -> list[StoredGroup] | None:
        return self._batches.get(batch_id)

    def batch_ids(self) -> list[str]:
        return list(self._batches)

    def ack(self, batch_id: str) -> list[StoredGroup] | None:
        """Free the slots of a trained batch; None for an unknown batch id."""
        groups = self._batches.pop(batch_id, None)
        if groups is None:
            return None
        for group in groups:
            del self._batch_of[group.group_id]
            self.training_bytes -= group.num_bytes
        return groups

    def unserve(self, batch_id: str) -> list[StoredGroup]:
        """Put a served batch's groups back in arrival order (the learner is gone, or the send failed)."""
        groups = self.ack(batch_id) or []
        if groups:
            merged = sorted([*self._buffered.values(), *groups], key=lambda g: g.seq)
            self._buffered = OrderedDict((g.group_id, g) for g in merged)
            self.buffered_bytes += sum(g.num_bytes for g in groups)
        return groups

    def discard(self, group_id: str) -> StoredGroup | None:
        """Remove one group wherever it is (trained by an ack this broker did not serve); None if not held."""
        group = self._buffered.pop(group_id, None)
        if group is not None:
            self.buffered_bytes -= group.num_bytes
            return group
        batch_id = self._batch_of.pop(group_id, None)
        if batch_id is None:
            return None
        groups = self._batches[batch_id]
        index = next(i for i, g in enumerate(groups) if g.group_id == group_id)
        group = groups.pop(index)
        if not groups:
            del self._batches[batch_id]
        self.training_bytes -= group.num_bytes
        return group

    def drop_stale(self, latest_version: int, max_staleness: int,
                   rule: StalenessRule = StalenessRule.NEWEST_TOKEN) -> list[StoredGroup]:
        """Remove and return buffered groups past the bound (:func:`loraflow.common.versions.group_is_too_stale`; training
        groups are the learner's)."""
        stale = [g for g in self._buffered.values()
                 if group_is_too_stale(latest_version, g.min_version, g.max_version, max_staleness, rule)]
        for group in stale:
            del self._buffered[group.group_id]
            self.buffered_bytes -= group.num_bytes
        return stale

    def drop_from(self, worker: str, session: str) -> list[StoredGroup]:
        """Remove and return the buffered groups one worker process submitted (it is quarantined); training
        groups are the learner's."""
        gone = [g for g in self._buffered.values() if (g.worker, g.session) == (worker, session)]
        for group in gone:
            del self._buffered[group.group_id]
            self.buffered_bytes -= group.num_bytes
        return gone

    # -- views -----------------------------------------------------------------------------------------------

    def buffered(self) -> list[StoredGroup]:
        """Buffered groups, oldest first."""
        return list(self._buffered.values())

    def staleness_histogram(self, latest_version: int) -> dict[int, int]:
        """Staleness (latest version - newest token version, what the rule keeps a group by) -> buffered groups."""
        return dict(sorted(Counter(latest_version - g.max_version for g in self._buffered.values()).items()))
