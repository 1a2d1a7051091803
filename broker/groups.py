"""Arriving RolloutGroups: the verdict on each, decided before anything changes, and what it does to the broker.

:func:`judge` runs every check on a decoded group and returns a :class:`Verdict`; it reads the ledger and
the run's state and changes nothing, so a handler applies the verdict whole or not at all. In order::

    group id is a prompt this broker issued?                   no  -> unknown_lease (nobody's lease touched)
    lease id granted to this client for this prompt (its MAC)? no  -> unknown_lease (lease_not_yours)
    sender quarantined (loraflow.broker.quarantine)?           yes -> refuse: quarantined
    prompt buffered / training / trained already?              yes -> duplicate (Ack)
    group_size samples, values valid (loraflow.common.protocol)? no -> refuse: invalid_group / malformed
    newest token within max_staleness of the latest?           no  -> refuse: stale (dropped{stale_on_arrival})
    tokens of a withdrawn version (loraflow.broker.history)?   yes -> refuse: withdrawn (dropped{withdrawn_on_arrival})
    fits the buffer's byte bound?                              no  -> refuse: buffer_full (dropped{buffer_full})
    otherwise                                                      -> accept

:class:`GroupDesk` applies it (:meth:`GroupDesk.judge` runs before the core's apply half begins,
:meth:`GroupDesk.apply` after: :mod:`loraflow.broker.dispatch`)::

    unknown:   Error, no lease touched (validation: nothing applied)
    refuse:    the sender's lease of that prompt ends (its prompt re-queued), Error
    accept:    GroupLedger.accept (buffered), progress and counters, Ack "accepted"
    duplicate: Ack "duplicate" (the worker re-sent a group the broker holds)

A *refused* group's prompt goes back to the queue at once when the sender holds its lease; a group for a
prompt whose lease expired is still accepted (any newer lease on it is cancelled by
:meth:`loraflow.broker.ledger.GroupLedger.accept`). Acks go one per group, or together once per loop pass to
clients that read ``GroupAck.ref_ids`` (``Hello.batched_acks``).

Staleness is judged by the group's newest token (``max_version``; :func:`loraflow.common.versions.group_is_too_stale`
under the ledger's ``staleness_rule``): a group that still holds a token the learner may train is kept, and the
learner masks its tokens older than the bound. Judged by its oldest token, a long completion, whose first
tokens age while it generates, would be the likeliest to be dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from loraflow.broker.buffer import StoredGroup
from loraflow.broker.history import RunProgress, TrainingHistory
from loraflow.broker.ledger import GroupLedger, Reason, State
from loraflow.broker.outbox import Outbox
from loraflow.broker.peers import Peer
from loraflow.broker.prompts import PromptKey, parse_group_id
from loraflow.broker.quarantine import Quarantine, Status
from loraflow.broker.stats import BrokerStats
from loraflow.common import framing, group_checks, protocol, versions
from loraflow.common.codes import ProtocolError
from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Kind
from loraflow.common.versions import VersionRange

log = get_logger("broker")

ACCEPT, DUPLICATE, UNKNOWN, REFUSE = "accept", "duplicate", "unknown", "refuse"


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: str  # ACCEPT, DUPLICATE, UNKNOWN (Error, no lease touched) or REFUSE (Error, the sender's lease back)
    key: PromptKey | None = None
    code: str = ""  # the Error's code
    message: str = ""
    reason: str | None = None  # rejected{reason}, when not the code
    dropped: str | None = None  # dropped{...}, counted for some refusals
    state: State = State.NEW  # the prompt's, as judged


def token_versions(specs: list[Any], frames: list[Any]) -> np.ndarray:
    """The per-token policy versions of one group: a numpy view of its ``versions`` frame (specs as received,
    :class:`loraflow.common.framing.TensorSpec`)."""
    for spec in specs:
        if spec.name == "versions":
            return framing.as_numpy(spec, frames[spec.frame])
    raise AssertionError("a validated group always has a versions tensor")


def holds_withdrawn(withdrawn: list[VersionRange], min_version: int, max_version: int, specs: list[Any],
                    frames: list[Any]) -> bool:
    """Whether a group holds a token of a withdrawn version (the range test first: it reads no tensor)."""
    return bool(withdrawn) and versions.overlaps(withdrawn, min_version, max_version) \
        and versions.touches(withdrawn, token_versions(specs, frames))


def judge(group: protocol.RolloutGroup, envelope: framing.Envelope, identity: bytes, *, ledger: GroupLedger,
          quarantined: bool, group_size: int, vocab_size: int, latest_version: int, max_staleness: int,
          withdrawn: list[VersionRange]) -> Verdict:
    """The verdict on one decoded RolloutGroup from ``identity`` (see the module docstring); changes nothing."""
    gid = group.group_id
    key = parse_group_id(gid)
    state = ledger.state(key) if key is not None else State.NEW
    if key is None or state is State.NEW:
        return Verdict(UNKNOWN, key, "unknown_lease", f"group {gid!r} (lease {group.lease_id!r}) was never "
                       "leased by this broker")
    if not ledger.leases.issued_to(group.lease_id, key, identity):
        return Verdict(UNKNOWN, key, "unknown_lease", f"group {gid!r}: lease {group.lease_id!r} was not granted "
                       "to this client for this prompt (a lease binds the client it was granted to)",
                       reason="lease_not_yours")
    if quarantined:
        return Verdict(REFUSE, key, "quarantined", f"RolloutGroup {gid}: this worker process is quarantined, its "
                       "rollouts failed the learner's policy check (see `loraflow status`; common/integrity.py); "
                       "fix its engine and restart it")
    if state in (State.BUFFERED, State.TRAINING, State.TRAINED):
        return Verdict(DUPLICATE, key)
    try:
        if group.num_samples != group_size:
            raise ProtocolError(f"RolloutGroup {gid}: {group.num_samples} samples, the run's group_size is "
                                f"{group_size} (groups travel whole)", code="invalid_group")
        group_checks.check_group_values(group, envelope.specs, envelope.frames, vocab_size=vocab_size,
                                    latest_version=latest_version)
    except ProtocolError as exc:
        return Verdict(REFUSE, key, exc.code, str(exc))
    rule = ledger.staleness_rule
    if versions.group_is_too_stale(latest_version, group.min_version, group.max_version, max_staleness, rule):
        field = "max_version" if rule is versions.StalenessRule.NEWEST_TOKEN else "min_version"
        return Verdict(REFUSE, key, "invalid_group", f"RolloutGroup {gid}: {field} {getattr(group, field)} is more "
                       f"than max_staleness {max_staleness} behind version {latest_version}; the prompt was "
                       "re-queued", reason="stale", dropped="stale_on_arrival")
    if holds_withdrawn(withdrawn, group.min_version, group.max_version, envelope.specs, envelope.frames):
        return Verdict(REFUSE, key, "invalid_group", f"RolloutGroup {gid}: holds tokens of a withdrawn version "
                       f"{withdrawn} (a restarted learner rolled it back); the prompt was re-queued",
                       reason="withdrawn", dropped="withdrawn_on_arrival")
    buffer = ledger.buffer
    if not buffer.fits(envelope.num_bytes):
        return Verdict(REFUSE, key, "limit", f"RolloutGroup {gid}: {envelope.num_bytes} bytes do not fit the "
                       f"buffer ({buffer.memory_bytes} of broker.max_buffer_bytes={buffer.max_bytes} used, counting "
                       "per-group overhead); the prompt was re-queued", reason="buffer_full", dropped="buffer_full")
    return Verdict(ACCEPT, key, state=state)


def stored(group: protocol.RolloutGroup, envelope: framing.Envelope, key: PromptKey, *, worker: str, session: str,
           now_s: float) -> StoredGroup:
    """An accepted group as the buffer keeps it: its frames untouched, its record and specs as received, and
    the process that submitted it as registered (``worker``, ``session``), not as the group claims (the record
    says so too: it is the broker's now and goes into a Batch as it is)."""
    group.worker_id, group.worker_session = worker, session
    return StoredGroup(group_id=group.group_id, key=key, header=group, wire_specs=envelope.specs,
                       frames=envelope.frames,
                       num_bytes=envelope.num_bytes, min_version=group.min_version, max_version=group.max_version,
                       num_tokens=sum(group.completion_lens), worker=worker, session=session, received_s=now_s)


class GroupDesk:
    """Verdicts on RolloutGroups and their application to the ledger."""

    def __init__(self, config: Config, *, ledger: GroupLedger, quarantine: Quarantine, history: TrainingHistory,
                 progress: RunProgress, outbox: Outbox, stats: BrokerStats, vocab_size: int) -> None:
        self.group_size, self.max_staleness = config.run.group_size, config.run.max_staleness
        self.vocab_size = vocab_size
        self.ledger, self.quarantine, self.history, self.progress = ledger, quarantine, history, progress
        self.outbox, self.stats = outbox, stats

    def judge(self, identity: bytes, peer: Peer, group: protocol.RolloutGroup,
              envelope: framing.Envelope) -> Verdict:
        """The verdict; changes nothing."""
        return judge(group, envelope, identity, ledger=self.ledger, group_size=self.group_size,
                            quarantined=self.quarantine.status((peer.client_id, peer.session)) is Status.QUARANTINED,
                            vocab_size=self.vocab_size, latest_version=self.progress.latest_version,
                            max_staleness=self.max_staleness, withdrawn=self.history.withdrawn)

    def reject(self, identity: bytes, peer: Peer, verdict: Verdict, group_id: str) -> None:
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
              verdict: Verdict, now_s: float) -> None:
        """What a refuse, accept or duplicate verdict does (an unknown one is only rejected)."""
        gid = group.group_id
        if verdict.outcome == REFUSE:
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
        if verdict.outcome == ACCEPT:
            kept = stored(group, envelope, verdict.key, worker=peer.client_id, session=peer.session, now_s=now_s)
            self.ledger.accept(kept, group.lease_id, old=verdict.state)
            self.progress.group_accepted(envelope.num_bytes)
            peer.num_groups_accepted += 1
            self.stats.tokens_accepted += kept.num_tokens
            status = "accepted"
        else:
            self.stats.count("groups", "duplicate")
            status = "duplicate"
        if peer.batched_acks:  # one Ack per status for its groups of this loop pass
            self.outbox.ack_group(identity, status, gid)
        else:
            self.outbox.send_record(identity, protocol.GroupAck(ref_id=gid, status=status))
