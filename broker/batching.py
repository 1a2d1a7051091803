"""Batch requests and batch acks: groups out to the learner, its verdicts back, and policy integrity.

    BatchRequest -> drop stale buffered groups (newest token past the bound; re-queued) -> GroupLedger.serve
                    oldest whole groups -> Batch
                    (or park / wait; when every epoch is issued and only buffered groups remain, a short final batch)
    BatchAck     -> GroupLedger.settle: listed ids trained (recorded until a learner checkpoint covers them,
                    loraflow.broker.history), unlisted re-queued; ids of a batch this broker did not serve (it restarted)
                    marked trained -> Ack after the state write (the core's outbox)

A Batch forwards each group's frames as received (``framing.pack_raw``'s layout with the specs kept from the
group's arrival); one zmq refuses to send goes back to the buffer (``restored``). So does every batch in
flight when the learner goes away.

Policy integrity (:mod:`loraflow.broker.quarantine`): a BatchAck's ``mismatches`` are failed checks and its listed groups
passed ones, each counted against the worker process that submitted the group (the buffer's record, never the
group's own ``worker_id``); a failed group is re-queued like any unlisted one (``dropped{policy_mismatch}``).
A process that is quarantined loses its leases and buffered groups at once (prompts re-queued); what else the
status means is :mod:`loraflow.broker.leasing`'s (no leases; one at a time on probation) and :mod:`loraflow.broker.groups`'s (its
groups refused).
"""

from __future__ import annotations

from collections.abc import Callable

from loraflow.broker.buffer import StoredGroup
from loraflow.broker.groups import holds_withdrawn
from loraflow.broker.history import RunProgress, TrainingHistory
from loraflow.broker.ledger import GroupLedger, Reason
from loraflow.broker.outbox import Outbox, Waiter, WaiterQueue
from loraflow.broker.peers import PeerRegistry
from loraflow.broker.prompts import parse_group_id
from loraflow.broker.quarantine import Quarantine, Transition, WorkerKey
from loraflow.broker.stats import BrokerStats
from loraflow.common import codec, protocol, versions
from loraflow.common.framing import TensorSpec
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Kind

log = get_logger("broker")


class BatchDesk:
    """Serving batches, settling their acks, and the quarantine that follows from the learner's checks."""

    def __init__(self, *, broker_id: str, max_staleness: int, ledger: GroupLedger, history: TrainingHistory,
                 quarantine: Quarantine, peers: PeerRegistry, progress: RunProgress, outbox: Outbox,
                 stats: BrokerStats, to_unix: Callable[[float], float]) -> None:
        self.broker_id = broker_id
        self.max_staleness = max_staleness
        self.ledger, self.history, self.quarantine, self.peers = ledger, history, quarantine, peers
        self.progress, self.outbox, self.stats = progress, outbox, stats
        self.to_unix = to_unix  # a now_s reading as unix time (for the evidence shown by `loraflow status`)
        self.waiters = WaiterQueue()
        self._seq = 0
        self._stale_checked_version = -1

    # -- serving ---------------------------------------------------------------------------------------------

    def request(self, identity: bytes, request: protocol.BatchRequest, now_s: float) -> None:
        self.progress.learner["learner_version"] = request.learner_version
        self.drop_stale()
        self.waiters.remove(identity)  # a newer request replaces a parked one (loraflow.broker.outbox.WaiterQueue)
        if not self.try_serve(identity, request, final=request.wait_ms == 0):
            self.waiters.park(Waiter(identity=identity, request=request, deadline_s=now_s + request.wait_ms / 1000))

    def try_serve(self, identity: bytes, request: protocol.BatchRequest, final: bool) -> bool:
        """Serve the oldest groups; returns False (nothing sent) when there are not enough and not final."""
        latest = self.progress.latest_version
        batch_id = f"{self.broker_id}.{self._seq + 1}"
        num_groups = request.num_groups
        buffered = self.ledger.buffer.num_buffered
        if buffered < num_groups and self.ledger.nothing_more_to_come():
            num_groups = buffered  # the dataset's last groups: a short batch, else it never ends
        groups = self.ledger.serve(num_groups, batch_id)
        if groups is None:
            if final:
                self.outbox.send_record(identity, protocol.Batch(latest_version=latest))
            return final
        self._seq += 1
        entries, specs, frames = [], [], []
        for group in groups:
            self.stats.count("served_staleness", versions.staleness(latest, group.max_version))
            # the submitting process as the broker knows it, not as the group claims (the learner's lora_id memory)
            entries.append(protocol.BatchEntry(group=group.header, first_tensor=len(specs)))
            base = len(frames)
            specs.extend(TensorSpec(s.name, s.dtype, s.shape, base + s.frame) for s in group.wire_specs)
            frames.extend(group.frames)
        batch = protocol.Batch(batch_id=batch_id, groups=entries, latest_version=latest)
        message = codec.encode_with_frames(batch, specs, frames)
        self.outbox.send(identity, Kind.BATCH, message, on_fail=lambda: self.unserve(batch_id),
                         num_bytes=sum(g.num_bytes for g in groups))
        return True

    def serve_waiters(self) -> None:
        if self.waiters:
            self.drop_stale()
        while self.waiters and self.try_serve(self.waiters.first().identity, self.waiters.first().request,
                                              final=False):
            self.waiters.remove(self.waiters.first().identity)

    def expire_waiters(self, now_s: float) -> None:
        for waiter in self.waiters.expired(now_s):
            self.try_serve(waiter.identity, waiter.request, final=True)

    def drain(self) -> None:
        """Shutting down: every parked request answered (an empty Batch)."""
        for waiter in self.waiters:
            self.try_serve(waiter.identity, waiter.request, final=True)
        self.waiters.clear()

    def unserve(self, batch_id: str) -> None:
        if self.ledger.unserve(batch_id):
            self._stale_checked_version = -1  # restored groups may have aged while in training: check again

    def learner_gone(self) -> None:
        """Every batch in flight back to the buffer."""
        if self.ledger.unserve_all():
            self._stale_checked_version = -1

    # -- dropping --------------------------------------------------------------------------------------------

    def drop_stale(self) -> None:
        latest = self.progress.latest_version
        if self._stale_checked_version == latest:
            return
        self._stale_checked_version = latest
        dropped = self.ledger.drop_stale(latest, self.max_staleness)
        if dropped:
            log.info("stale_groups_dropped", num_groups=len(dropped), latest_version=latest,
                     max_staleness=self.max_staleness, requeued=[g.group_id for g in dropped[:8]])

    def drop_withdrawn(self) -> None:
        """Take buffered groups holding a withdrawn version's tokens out of the buffer; their prompts re-queued."""
        withdrawn = self.history.withdrawn
        dropped = [g for g in self.ledger.buffered()
                   if holds_withdrawn(withdrawn, g.min_version, g.max_version, g.wire_specs, g.frames)]
        self.ledger.drop_buffered(dropped, Reason.WITHDRAWN)
        if dropped:
            log.info("withdrawn_groups_dropped", num_groups=len(dropped), withdrawn=withdrawn,
                     requeued=[g.group_id for g in dropped[:8]])

    # -- acks ------------------------------------------------------------------------------------------------

    def knows(self, ack: protocol.BatchAck) -> bool:
        """Whether a BatchAck can be applied: a batch this broker served, or one that lists its groups."""
        return bool(ack.group_ids) or self.ledger.buffer.batch(ack.batch_id) is not None

    def settle(self, ack: protocol.BatchAck, now_s: float) -> None:
        """Apply a BatchAck (:meth:`knows` it): the list is authoritative, unlisted = not trained."""
        listed = set(ack.group_ids)
        failed = {m.group_id: m for m in ack.mismatches}
        for mismatch in ack.mismatches:
            self.stats.count("policy_mismatches", mismatch.reason)
        settled = self.ledger.settle(ack.batch_id, listed, set(failed)) or []
        num_trained = 0
        for group, trained in settled:
            if trained:
                num_trained += 1
                self.history.record(group.key, ack.trained_version)
            if trained or group.group_id in failed:
                self._checked(group, failed.get(group.group_id), now_s)
        for group_id in listed - {g.group_id for g, _ in settled}:  # a batch of the broker before a restart
            key = parse_group_id(group_id)
            if key is not None and self.ledger.mark_trained(key):
                num_trained += 1
                self.history.record(key, ack.trained_version)
        self.progress.trained(num_trained)
        self.history.commit(ack.checkpoint_version)
        self.progress.learner.update(step=ack.step, trained_version=ack.trained_version,
                                     checkpoint_version=ack.checkpoint_version)

    # -- policy integrity ------------------------------------------------------------------------------------

    def _checked(self, group: StoredGroup, mismatch: protocol.PolicyMismatch | None, now_s: float) -> None:
        """The learner's verdict on one group this broker served: counted against the process that sent it."""
        worker = (group.worker, group.session)
        transition = self.quarantine.record(worker, mismatch, now_s)
        if transition is Transition.QUARANTINED:
            self._quarantine(worker, now_s)
        elif transition is Transition.CLEARED:
            self.stats.count("quarantines", "cleared")
            log.info("worker_cleared", worker=worker[0], session=worker[1], group_id=group.group_id)

    def _quarantine(self, worker: WorkerKey, now_s: float) -> None:
        """Take back what a newly quarantined process holds: its buffered groups and its leases (re-queued)."""
        dropped = self.ledger.drop_from(*worker)
        peer = self.peers.worker(*worker)
        leases = self.ledger.end_leases_of(peer.identity, Reason.QUARANTINED) if peer is not None else []
        self.stats.count("quarantines", "quarantined")
        row = self.quarantine.row(worker, now_s, self.to_unix(now_s))
        log.warning("worker_quarantined", worker=worker[0], session=worker[1], connected=peer is not None,
                    num_failed=row["num_failed"], num_checked=row["num_checked"],
                    num_quarantines=row["num_quarantines"], dropped=len(dropped), leases_returned=len(leases),
                    evidence=[{k: e[k] for k in ("group_id", "reason", "version", "num_off", "num_checked",
                                                 "max_abs_diff", "detail")} for e in row["evidence"]])
