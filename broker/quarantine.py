"""Quarantine: which worker processes keep sending rollouts that fail the learner's policy check.

The learner re-scores what every group claims (:mod:`loraflow.common.integrity`) and reports each group that fails in
``BatchAck.mismatches``; a group it lists in ``BatchAck.group_ids`` passed. This module turns those outcomes
into a status per *worker process*, ``(client id, session)``: a restarted worker is another process, with a
clean slate but on probation::

    ok ----quarantine_after failures among its last quarantine_window checked groups----> quarantined
    quarantined ----a Hello of the same client id with a NEW session (the process restarted)----> probation
    probation ----one of its groups passes----> ok
    probation ----one of its groups fails----> quarantined (at once)

A reconnect (a Hello with the same session) changes nothing: the process that failed stays out. The old
process's record stays quarantined after its successor's Hello (*superseded*: shown no more, and a later
restart is not sent to probation by it again). Outcomes are attributed by the broker's own record of who
submitted the group (:class:`loraflow.broker.buffer.StoredGroup` ``worker`` + ``session``), never by the ``worker_id``
a group or a mismatch claims. Each process keeps the last :data:`MAX_EVIDENCE` failures (the learner's
:class:`loraflow.common.protocol.PolicyMismatch` records) so that ``loraflow status`` can say why.

What the statuses mean for the broker is :mod:`loraflow.broker.batching`'s (its hooks, on each BatchAck),
:mod:`loraflow.broker.leasing`'s and :mod:`loraflow.broker.groups`'s part: a quarantined process gets no leases
(``LeaseGrant.reason = "quarantined"``), its leases and buffered groups are taken back (prompts re-queued), and
its groups are refused (Error ``quarantined``); a process on probation holds one lease at a time.

Pure logic: no sockets, the caller's clock (``now_s``, ``time.monotonic()``). Bounded: at most
:data:`MAX_TRACKED` processes are remembered (the least recently checked healthy ones are forgotten first).

Survives a broker restart: the state file (:mod:`loraflow.broker.state`, field ``quarantine``) keeps up to
:data:`MAX_PERSISTED` flagged records (:meth:`Quarantine.persisted`: the current ones before the superseded,
the most recently flagged first), and :meth:`Quarantine.put` puts them back, so a quarantined process that
reconnects to the new broker (same session) stays out and a restarted one (new session) is on probation as
before. Healthy records are not kept: a process's passes before the restart are forgotten. A flagged record past
the cap is lost at a restart (the state file counts them): that process starts clean and is quarantined again
after ``quarantine_after`` failures, and a restart of it is not sent to probation.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from loraflow.common.protocol import PolicyMismatch

#: (client id, session) of a worker process
WorkerKey = tuple[str, str]

MAX_EVIDENCE = 4  # failures kept per process, newest last
MAX_TRACKED = 4096  # worker processes remembered
MAX_PERSISTED = 128  # flagged processes kept in the state file (the Stats view lists 64 of each status)


class Status(enum.StrEnum):
    OK = "ok"
    QUARANTINED = "quarantined"
    PROBATION = "probation"


class Transition(enum.StrEnum):
    """What one outcome did to a process's status."""

    NONE = ""
    QUARANTINED = "quarantined"
    CLEARED = "cleared"  # a process on probation passed


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """One failed group, as the learner reported it, and when the broker heard of it."""

    group_id: str
    reason: str
    version: int
    num_checked: int
    num_off: int
    max_abs_diff: float
    mean_abs_diff: float
    detail: str
    at_s: float

    @classmethod
    def of(cls, mismatch: PolicyMismatch, now_s: float) -> Evidence:
        return cls(group_id=mismatch.group_id, reason=mismatch.reason, version=mismatch.version,
                   num_checked=mismatch.num_checked, num_off=mismatch.num_off, max_abs_diff=mismatch.max_abs_diff,
                   mean_abs_diff=mismatch.mean_abs_diff, detail=mismatch.detail, at_s=now_s)

    def to_dict(self, now_s: float, now_unix: float) -> dict[str, Any]:
        return {"group_id": self.group_id, "reason": self.reason, "version": self.version,
                "num_checked": self.num_checked, "num_off": self.num_off,
                "max_abs_diff": round(self.max_abs_diff, 6), "mean_abs_diff": round(self.mean_abs_diff, 6),
                "detail": self.detail, "age_s": round(now_s - self.at_s, 3),
                "when_unix": round(now_unix - (now_s - self.at_s), 3)}


@dataclass(slots=True, kw_only=True)
class Record:
    """One worker process: its last outcomes (True = failed), its last failures, its status."""

    outcomes: deque[bool]
    evidence: deque[Evidence] = field(default_factory=lambda: deque(maxlen=MAX_EVIDENCE))
    status: Status = Status.OK
    since_s: float = 0.0  # when the status was last set
    num_quarantines: int = 0  # of this client id, carried over restarts
    superseded: bool = False  # a newer session of its client id said Hello


class Quarantine:
    """Status of every worker process from the outcomes of its checked groups (see the module docstring)."""

    def __init__(self, *, after: int, window: int, max_tracked: int = MAX_TRACKED) -> None:
        if not 1 <= after <= window:
            raise ValueError(f"quarantine needs 1 <= quarantine_after <= quarantine_window, got {after}, {window}")
        self.after = after
        self.window = window
        self.max_tracked = max_tracked
        self._records: OrderedDict[WorkerKey, Record] = OrderedDict()  # least recently checked first

    def status(self, worker: WorkerKey) -> Status:
        record = self._records.get(worker)
        return Status.OK if record is None else record.status

    def get(self, worker: WorkerKey) -> Record | None:
        return self._records.get(worker)

    def record(self, worker: WorkerKey, mismatch: PolicyMismatch | None, now_s: float) -> Transition:
        """One checked group of ``worker``: passed (``mismatch`` None) or failed with that evidence."""
        record = self._touch(worker)
        failed = mismatch is not None
        record.outcomes.append(failed)
        if failed:
            record.evidence.append(Evidence.of(mismatch, now_s))
        if record.status is Status.PROBATION:
            if failed:
                return self._set(record, Status.QUARANTINED, now_s)
            return self._set(record, Status.OK, now_s)
        if record.status is Status.OK and failed and sum(record.outcomes) >= self.after:
            return self._set(record, Status.QUARANTINED, now_s)
        return Transition.NONE

    def rejoin(self, client_id: str, session: str, now_s: float) -> bool:
        """A worker's Hello: a new session of a client id whose process is quarantined or on probation starts on
        probation (True), carrying the evidence over; the old processes' records are superseded."""
        current = self._records.get((client_id, session))
        if current is not None and current.status is not Status.OK:
            return False  # a reconnect: that process keeps its status
        flagged = [r for (cid, s), r in self._records.items()
                   if cid == client_id and s != session and r.status is not Status.OK and not r.superseded]
        if not flagged:
            return False
        record = self._touch((client_id, session))
        record.status, record.since_s = Status.PROBATION, now_s
        for old in flagged:
            old.superseded = True
            record.num_quarantines = max(record.num_quarantines, old.num_quarantines)
            record.evidence.extend(old.evidence)
        return True

    def put(self, worker: WorkerKey, record: Record) -> None:
        """A record a previous broker persisted, back as it was (the caller built it on this clock)."""
        if record.outcomes.maxlen != self.window:
            record.outcomes = deque(record.outcomes, maxlen=self.window)
        self._records.pop(worker, None)
        self._forget_one()
        self._records[worker] = record

    def persisted(self, limit: int = MAX_PERSISTED) -> tuple[list[tuple[WorkerKey, Record]], int]:
        """The flagged records a restarted broker needs, at most ``limit`` of them (current processes before
        superseded ones, then the most recently flagged first), and how many flagged ones were left out."""
        rows = [(k, r) for k, r in self._records.items() if r.status is not Status.OK]
        rows.sort(key=lambda kr: (kr[1].superseded, -kr[1].since_s))
        return rows[:limit], max(0, len(rows) - limit)

    def _touch(self, worker: WorkerKey) -> Record:
        record = self._records.pop(worker, None)
        if record is None:
            record = Record(outcomes=deque(maxlen=self.window))
            self._forget_one()
        self._records[worker] = record
        return record

    def _forget_one(self) -> None:
        """Make room for one more record: the least recently checked healthy process goes first."""
        if len(self._records) < self.max_tracked:
            return
        victim = next((k for k, r in self._records.items() if r.status is Status.OK or r.superseded),
                      next(iter(self._records)))
        del self._records[victim]

    @staticmethod
    def _set(record: Record, status: Status, now_s: float) -> Transition:
        record.status, record.since_s = status, now_s
        if status is Status.QUARANTINED:
            record.num_quarantines += 1
            return Transition.QUARANTINED
        return Transition.CLEARED

    # -- views -----------------------------------------------------------------------------------------------

    def flagged(self, status: Status) -> list[tuple[WorkerKey, Record]]:
        """The current processes (not superseded) with this status, longest in it first."""
        rows = [(k, r) for k, r in self._records.items() if r.status is status and not r.superseded]
        return sorted(rows, key=lambda kr: kr[1].since_s)

    def count(self, status: Status) -> int:
        return len(self.flagged(status))

    def row(self, worker: WorkerKey, now_s: float, now_unix: float) -> dict[str, Any]:
        record = self._records[worker]
        return {"worker": worker[0], "session": worker[1], "status": str(record.status),
                "since_s": round(now_s - record.since_s, 3), "num_failed": sum(record.outcomes),
                "num_checked": len(record.outcomes), "num_quarantines": record.num_quarantines,
                "evidence": [e.to_dict(now_s, now_unix) for e in record.evidence]}

    def snapshot(self, now_s: float, now_unix: float, limit: int = 64) -> dict[str, Any]:
        """The quarantined and probation processes with their evidence (the ``limit`` longest flagged of each:
        a Stats reply stays small), and how many there are."""
        out: dict[str, Any] = {}
        for status in (Status.QUARANTINED, Status.PROBATION):
            flagged = self.flagged(status)
            out[str(status)] = [self.row(k, now_s, now_unix) for k, _ in flagged[:limit]]
            out[f"num_{status}"] = len(flagged)
        return out
