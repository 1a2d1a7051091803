"""A broker's start from what the previous process left on disk, and what it leaves for the next one.

:func:`restore` reads ``state.json`` (:mod:`loraflow.broker.state`) and ``adapter.bin`` and returns the parts the core
runs on: the group ledger (every pending key and the reserved block re-queued, the cursor after the block:
:meth:`loraflow.broker.ledger.GroupLedger.restored`), where the run stands (:class:`loraflow.broker.history.RunProgress`), the
training history and the lease secret (so that leases granted before the restart still verify), and it puts
the flagged worker processes back into the quarantine (a quarantined process stays out across the restart).
:func:`state_of` is the inverse: the state to write, read off the same parts, and :class:`StateKeeper` writes it.
Times in the file are wall clock (``time.time()``); the parts run on the core's monotonic clock, and
``to_unix`` converts (the core's: its start time on both clocks).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from loraflow.broker.adapters import AdapterCache
from loraflow.broker.buffer import RolloutBuffer
from loraflow.broker.history import RunProgress, TrainingHistory
from loraflow.broker.ledger import GroupLedger
from loraflow.broker.prompts import LeaseTable, PromptSource
from loraflow.broker.quarantine import MAX_EVIDENCE, Evidence, Quarantine, Record, Status
from loraflow.broker.state import (
    BrokerState,
    EvidenceEntry,
    QuarantineEntry,
    QuarantineState,
    StateWriter,
    check_matches,
    load_adapter,
    load_state,
    make_state,
)
from loraflow.broker.stats import BrokerStats
from loraflow.common import codec, protocol
from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.task_base import Task

log = get_logger("broker")

RESERVE_BLOCK = 4096  # new prompt keys handed out per state-file write (re-queued, not lost, after a crash)


@dataclass(slots=True, kw_only=True)
class Restored:
    ledger: GroupLedger
    progress: RunProgress
    history: TrainingHistory
    lease_secret: str  # hex


def restore(config: Config, task: Task, *, state_path: Path | None, adapter_path: Path | None,
            adapters: AdapterCache, stats: BrokerStats, broker_id: str, quarantine: Quarantine,
            to_unix: Callable[[float], float]) -> Restored:
    """The ledger, progress, history and newest adapter (into ``adapters``) as the last process left them, and
    its flagged worker processes (into ``quarantine``)."""
    broker, run, learner = config.broker, config.run, config.learner
    source = partial(PromptSource, task, prompt_limit=broker.prompt_limit, num_epochs=broker.num_epochs,
                     reserve_block=max(RESERVE_BLOCK, 4 * config.capacity_groups))
    max_records = (2 * learner.checkpoint_every * run.groups_per_step + config.capacity_groups
                   if learner.checkpoint_every else 0)
    progress = RunProgress()
    history = TrainingHistory(max_records=max_records)
    lease_secret = secrets.token_hex(32)
    persisted = load_state(state_path) if state_path else None
    if persisted is not None:
        check_matches(persisted, task=run.task, seed=run.seed, epoch_size=source().epoch_size, path=str(state_path))
        progress.latest_version, progress.latest_sha256 = persisted.latest_version, persisted.latest_sha256
        progress.num_trained_total = persisted.num_trained_groups
        lease_secret = persisted.lease_secret or lease_secret
        history = TrainingHistory(max_records=max_records, learner_session=persisted.learner_session,
                                  uncommitted=persisted.uncommitted_records(), withdrawn=persisted.withdrawn_ranges())
        _restore_quarantine(persisted.quarantine, quarantine, to_unix)
    if adapter_path is not None:
        _restore_adapter(adapter_path, adapters, progress, history)
    progress.base_version = progress.latest_version
    parts = dict(buffer=RolloutBuffer(max_groups=config.capacity_groups, max_bytes=broker.max_buffer_bytes),
                 leases=LeaseTable(timeout_s=broker.lease_timeout_s, max_per_worker=broker.max_leases_per_worker,
                                   id_prefix=f"{broker_id[:6]}.", secret=bytes.fromhex(lease_secret)),
                 count=stats.count)
    if persisted is None:
        ledger = GroupLedger(source(), **parts)
    else:
        ledger = GroupLedger.restored(source, cursor=persisted.cursor_key, reserved_until=persisted.reserved_key,
                                      pending=persisted.pending_keys(), num_epochs=broker.num_epochs, **parts)
        log.info("state_restored", path=str(state_path), cursor=list(persisted.reserved_key),
                 requeued=ledger.num_queued, latest_version=progress.latest_version)
    return Restored(ledger=ledger, progress=progress, history=history, lease_secret=lease_secret)


def _restore_adapter(path: Path, adapters: AdapterCache, progress: RunProgress, history: TrainingHistory) -> None:
    """Serve the adapter saved by the previous process (it may be one version ahead of the state file)."""
    frames = load_adapter(path)
    if frames is None:
        return
    update, envelope = codec.decode(frames)
    if not isinstance(update, protocol.AdapterUpdate):
        raise ValueError(f"{path} holds a {type(update).__name__}, not an AdapterUpdate; move it away")
    if history.is_withdrawn(update.version) or update.version < progress.latest_version:
        log.info("adapter_not_restored", version=update.version, path=str(path),
                 why="withdrawn" if history.is_withdrawn(update.version) else "older than the state")
        return
    adapters.add(update, envelope.specs, frames)
    progress.latest_version, progress.latest_sha256 = update.version, update.sha256.lower()
    log.info("adapter_restored", version=update.version, path=str(path))


def _evidence_fields(evidence: Evidence | EvidenceEntry) -> dict[str, Any]:
    """What an Evidence and its state-file entry share (all but the time, on their own clocks)."""
    return {name: getattr(evidence, name) for name in _EVIDENCE_FIELDS}


_EVIDENCE_FIELDS = tuple(f.name for f in dataclasses.fields(Evidence) if f.name != "at_s")


def _restore_quarantine(persisted: QuarantineState, quarantine: Quarantine, to_unix: Callable[[float], float]) -> None:
    """Put the persisted records back, on this process's clock (a time ahead of now, from a clock that went back
    or another machine's, counts as now)."""
    offset_s = to_unix(0.0)
    now_s = time.time() - offset_s

    def to_s(unix: float) -> float:
        return min(unix - offset_s, now_s)

    for entry in sorted(persisted.entries, key=lambda e: e.since_unix):  # least recently flagged first
        evidence = deque((Evidence(**_evidence_fields(e), at_s=to_s(e.when_unix)) for e in entry.evidence),
                         maxlen=MAX_EVIDENCE)
        # the order of passes and failures in the window is not kept: failures first (they leave it first)
        outcomes = deque([True] * entry.num_failed + [False] * (entry.num_checked - entry.num_failed),
                         maxlen=quarantine.window)
        quarantine.put((entry.worker, entry.session),
                       Record(outcomes=outcomes, evidence=evidence, status=Status(entry.status),
                              since_s=to_s(entry.since_unix), num_quarantines=entry.num_quarantines,
                              superseded=entry.superseded))
    if persisted.entries or persisted.num_left_out:
        log.info("quarantine_restored", num_quarantined=quarantine.count(Status.QUARANTINED),
                 num_probation=quarantine.count(Status.PROBATION), num_records=len(persisted.entries))
    if persisted.num_left_out:
        log.warning("quarantine_records_lost", num_left_out=persisted.num_left_out,
                    why="more flagged worker processes than the state file keeps; they start clean")


def _quarantine_state(quarantine: Quarantine, to_unix: Callable[[float], float]) -> QuarantineState:
    rows, num_left_out = quarantine.persisted()
    entries = [QuarantineEntry(
        worker=worker, session=session, status=str(r.status), since_unix=round(to_unix(r.since_s), 3),
        num_failed=sum(r.outcomes), num_checked=len(r.outcomes), num_quarantines=r.num_quarantines,
        superseded=r.superseded,
        evidence=[EvidenceEntry(**_evidence_fields(e), when_unix=round(to_unix(e.at_s), 3)) for e in r.evidence])
        for (worker, session), r in rows]
    return QuarantineState(entries=entries, num_left_out=num_left_out)


def state_of(config: Config, ledger: GroupLedger, progress: RunProgress, history: TrainingHistory,
             lease_secret: str, quarantine: Quarantine, to_unix: Callable[[float], float]) -> BrokerState:
    """The state file's contents now."""
    prompts = ledger.source
    return make_state(
        task=config.run.task, seed=config.run.seed, epoch_size=prompts.epoch_size, cursor=prompts.cursor,
        reserved_until=prompts.reserved_until, pending=ledger.pending_keys(), latest_version=progress.latest_version,
        num_trained_groups=progress.num_trained_total, latest_sha256=progress.latest_sha256,
        learner_session=history.learner_session, uncommitted=history.uncommitted.items(),
        withdrawn=history.withdrawn, lease_secret=lease_secret, quarantine=_quarantine_state(quarantine, to_unix))


class StateKeeper:
    """Writes the state (and the newest adapter with it): now, in the caller's thread (start, the reserved
    block, shutdown), or in the background writer, whose durable sequence number releases the replies that
    waited for it (:class:`loraflow.broker.outbox.Outbox`). Without a state file nothing is written."""

    def __init__(self, writer: StateWriter | None, *, state: Callable[[], BrokerState],
                 adapter: Callable[[], tuple[int, list[Any]] | None], stats: BrokerStats) -> None:
        self.writer, self._state, self._adapter, self._stats = writer, state, adapter, stats

    @property
    def durable_seq(self) -> int:
        return self.writer.durable_seq if self.writer is not None else 0

    def write_now(self) -> None:
        if self.writer is not None:
            self.writer.write(self._state(), self._adapter())
            self._stats.count("state_writes", "sync")

    def submit(self) -> int | None:
        """Hand the current state to the background writer; its sequence number (None: no state file)."""
        if self.writer is None:
            return None
        seq = self.writer.submit(self._state(), self._adapter())
        self._stats.count("state_writes", "background")
        return seq

    def close(self) -> None:
        """Finish a background write in progress, then write the state synchronously (shutting down)."""
        if self.writer is not None:
            self.writer.close()
        self.write_now()
