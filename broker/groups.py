"""Arriving RolloutGroups: the verdict (:func:`loraflow.broker.intake.judge`) and what it does to the broker.

    RolloutGroup -> judge -> unknown:   Error, no lease touched (validation: nothing applied)
                          -> refuse:    the sender's lease of that prompt ends (its prompt re-queued), Error
                          -> accept:    GroupLedger.accept (buffered), progress and counters, Ack "accepted"
                          -> duplicate: Ack "duplicate" (the worker re-sent a group the broker holds)

Acks go one per group, or together once per loop pass to clients that read ``GroupAck.ref_ids``
(``Hello.batched_acks``). The core runs :meth:`GroupDesk.judge` before its apply half begins and
:meth:`GroupDesk.apply` after (:mod:`loraflow.broker.dispatch`).
"""

from __future__ import annotations

from typing import Any

from loraflow.broker import intake
from loraflow.broker.history import TrainingHistory
from loraflow.broker.ledger import GroupLedger, Reason
from loraflow.broker.outbox import Outbox
from loraflow.broker.peers import Peer
from loraflow.broker.progress import RunProgress
from loraflow.broker.quarantine import Quarantine, Status
from loraflow.broker.stats import BrokerStats
from loraflow.common import framing, protocol
from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Kind

log = get_logger("broker")


class GroupDesk:
    """Verdicts on RolloutGroups and their application to the ledger."""

    def __init__(self, config: Config, *, ledger: GroupLedger, quarantine: Quarantine, history: TrainingHistory,
                 progress: RunProgress, outbox: Outbox, stats: BrokerStats, vocab_size: int) -> None:
        self.group_size, self.max_staleness = config.run.group_size, config.run.max_staleness
        self.vocab_size = vocab_size
        self.ledger, self.quarantine, self.history, self.progress = ledger, quarantine, history, progress
        self.outbox, self.stats = outbox, stats

    def judge(self, identity: bytes, peer: Peer, group: protocol.RolloutGroup,
              envelope: framing.Envelope) -> intake.Verdict:
        """The verdict; changes nothing."""
        return intake.judge(group, envelope, identity, ledger=self.ledger, group_size=self.group_size,
                            quarantined=self.quarantine.status((peer.client_id, peer.session)) is Status.QUARANTINED,
                            vocab_size=self.vocab_size, latest_version=self.progress.latest_version,
                            max_staleness=self.max_staleness, withdrawn=self.history.withdrawn)

    def reject(self, identity: bytes, peer: Peer, verdict: intake.Verdict, group_id: str) -> None:
        """The Error of a group that is not taken, counted against its sender."""
        peer.num_groups_rejected += 1
        self.outbox.reject(identity, verdict.code, verdict.message, ref_kind=Kind.ROLLOUT_GROUP, ref_id=group_id,
                           reason=verdict.reason)

    def malformed(self, identity: bytes, header: dict[str, Any]) -> None:
        """A RolloutGroup that failed its decode (the core sends the Error): the lease it names goes back at once
        if the sender holds it (the worker drops a refused group: waiting for lease_timeout_s would only idle the
        prompt)."""
        lease_id = header.get("lease_id")
        lease = self.ledger.leases.get(lease_id) if isinstance(lease_id, str) else None
        if lease is not None and lease.worker == identity:
            self.ledger.end_lease(lease, Reason.REFUSED)

    def apply(self, identity: bytes, peer: Peer, group: protocol.RolloutGroup, envelope: framing.Envelope,
              verdict: intake.Verdict, now_s: float) -> None:
        """What a refuse, accept or duplicate verdict does (an unknown one is only rejected)."""
        gid = group.group_id
        if verdict.outcome == intake.REFUSE:
            lease = self.ledger.leases.get(group.lease_id)
            if lease is not None and lease.key == verdict.key and lease.worker == identity:
                self.ledger.end_lease(lease, Reason.REFUSED)
            # otherwise the prompt is queued already, or leased again to another worker (theirs to deliver)
            if verdict.dropped:
                self.stats.count("dropped", verdict.dropped)
            log.info("group_refused", group_id=gid, worker=group.worker_id, code=verdict.code,
                     reason=verdict.reason or verdict.code, error=verdict.message[:200])
            self.reject(identity, peer, verdict, gid)
            return
        if verdict.outcome == intake.ACCEPT:
            stored = intake.stored(group, envelope, verdict.key, worker=peer.client_id, session=peer.session,
                                   now_s=now_s)
            self.ledger.accept(stored, group.lease_id, old=verdict.state)
            self.progress.group_accepted(envelope.num_bytes)
            peer.num_groups_accepted += 1
            self.stats.tokens_accepted += stored.num_tokens
            status = "accepted"
        else:
            self.stats.count("groups", "duplicate")
            status = "duplicate"
        if peer.batched_acks:  # one Ack per status for its groups of this loop pass
            self.outbox.ack_group(identity, status, gid)
        else:
            self.outbox.send_record(identity, protocol.GroupAck(ref_id=gid, status=status))
