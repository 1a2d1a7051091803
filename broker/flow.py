"""The data path of the broker: leases out, rollout groups in, batches out, batch acks in.

:class:`DataFlow` holds the message handlers for the five messages that move work, as a part of
:class:`broker.core.BrokerCore` (which owns the state they act on: ``prompts``, ``leases``, ``buffer``,
``peers``, ``stats``, ``latest_version``, the long-poll ``*_waiters`` and the ``_send``/``_reject`` helpers).
Keeping them here keeps the core to dispatch, registration, persistence and timers.

    LeaseRequest  -> admission.decide -> PromptSource.next -> LeaseTable.grant -> LeaseGrant (or park/wait)
    RolloutGroup  -> lease issued to this client for this prompt? -> dedup by group id -> value checks -> staleness -> withdrawn tokens -> byte bound -> buffer
                     -> Ack (or Error, prompt re-queued); to a client that reads Ack.ref_ids, one Ack per loop
                     pass for all its groups (of one status)
    BatchRequest  -> drop stale buffered groups (re-queued) -> serve oldest whole groups -> Batch (or park/wait;
                     when every epoch is issued and only buffered groups remain, a short final batch)
    BatchAck      -> listed ids trained (recorded until a learner checkpoint covers them, broker.history),
                     unlisted re-queued -> Ack after the state write
    LeaseReturn   -> re-queued

Policy integrity (:mod:`broker.quarantine`): a BatchAck's ``mismatches`` are failed checks and its listed groups
passed ones, each counted against the worker process that submitted the group (the buffer's record, never the
group's own ``worker_id``); a failed group is re-queued like any unlisted one (``dropped{policy_mismatch}``).
A process that is quarantined loses its leases and buffered groups at once (prompts re-queued), gets
``LeaseGrant(reason="quarantined")`` (at its long-poll's deadline) and has every group refused with Error
``quarantined``; its restart (a Hello with a new session) is on probation: one lease at a time until a group
of it passes.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from broker import admission
from broker.buffer import StoredGroup
from broker.leases import Lease
from broker.ledger import Reason, State
from broker.peers import Peer
from broker.prompts import PromptKey, group_id_of, parse_group_id
from broker.quarantine import Status, Transition, WorkerKey
from broker.waiters import Waiter
from common import framing, protocol, versions
from common.framing import TensorSpec
from common.logging import get_logger
from common.protocol import Kind, ProtocolError

log = get_logger("broker")


def token_versions(specs: list[Any], frames: list[Any]) -> np.ndarray:
    """The per-token policy versions of one group: a numpy view of its ``versions`` frame (specs as received,
    :class:`common.framing.TensorSpec`, or as kept in the buffer, wire dicts)."""
    for spec in specs:
        wire = spec if isinstance(spec, dict) else spec.to_wire()
        if wire["name"] == "versions":
            return framing.as_numpy(TensorSpec(wire["name"], wire["dtype"], tuple(wire["shape"]), wire["frame"]),
                                    frames[wire["frame"]])
    raise AssertionError("a validated group always has a versions tensor")


class DataFlow:
    """Handlers of the work-moving messages; mixed into BrokerCore (see the module docstring)."""

    @property
    def mean_group_footprint(self) -> float:
        """Mean bytes a group is charged in the buffer (0 before the first group)."""
        return self.mean_group_bytes + self.ledger.buffer.group_overhead_bytes if self.mean_group_bytes else 0.0

    # -- leases ----------------------------------------------------------------------------------------------

    def _admission_inputs(self, worker_version: int, worker_leases: int, requested: int,
                          max_leases_per_worker: int | None = None) -> admission.AdmissionInputs:
        if max_leases_per_worker is None:
            max_leases_per_worker = self.config.broker.max_leases_per_worker
        ledger = self.ledger
        return admission.AdmissionInputs(
            requested=requested, worker_version=worker_version, latest_version=self.latest_version,
            max_staleness=self.max_staleness, groups_per_step=self.groups_per_version,
            capacity_groups=self.capacity_groups, num_leased=ledger.num_leased, num_stored=ledger.num_held,
            num_trained_groups=self.num_trained_since_start, base_version=self.base_version,
            worker_leases=worker_leases, max_leases_per_worker=max_leases_per_worker,
            stored_bytes=ledger.buffer.memory_bytes, mean_group_bytes=self.mean_group_footprint,
            max_buffer_bytes=ledger.buffer.max_bytes, prompts_available=ledger.available(requested),
            draining=self.draining, worker_withdrawn=self.history.is_withdrawn(worker_version))

    def credit(self) -> int:
        """Groups any up-to-date worker could be leased now (capacity, admission limit, byte bound)."""
        return admission.credit(self._admission_inputs(self.latest_version, 0, 0))

    def _admission(self, identity: bytes, peer: Peer, requested: int) -> admission.Decision:
        on_probation = self.quarantine.status((peer.client_id, peer.session)) is Status.PROBATION
        return admission.decide(self._admission_inputs(peer.adapter_version, self.ledger.leases.count(identity), requested,
                                                       max_leases_per_worker=1 if on_probation else None))

    def _serve_lease_waiters(self, now_s: float) -> None:
        """Grant parked lease requests in arrival order while there is credit and something to lease."""
        if not self.lease_waiters or self.draining:
            return
        for waiter in self.lease_waiters:
            if not (self.credit() > 0 and self.ledger.available(1) > 0):
                return
            if self._answer_lease_waiter(waiter, now_s, final=False):
                self.lease_waiters.remove(waiter.identity)

    def _answer_stale_lease_waiters(self, now_s: float) -> None:
        """After a new or withdrawn version: parked requests of workers now too far behind, or holding a withdrawn
        version, get "stale_adapter" at once."""
        for waiter in self.lease_waiters:
            peer = self.peers.get(waiter.identity)
            if peer is not None and (self.history.is_withdrawn(peer.adapter_version) or not versions.worker_may_generate(
                    peer.adapter_version, self.latest_version, self.max_staleness)):
                self.lease_waiters.remove(waiter.identity)
                self._try_grant(waiter.identity, peer, waiter.request, now_s, final=True)

    def _on_lease_request(self, identity: bytes, peer: Peer, request: protocol.LeaseRequest, _env: Any,
                          _frames: Any, now_s: float) -> None:
        peer.adapter_version = request.adapter_version
        self.lease_waiters.remove(identity)  # a newer request replaces a parked one (broker.waiters)
        if not self._try_grant(identity, peer, request, now_s, final=request.wait_ms == 0):
            self.lease_waiters.park(Waiter(identity=identity, request=request, deadline_s=now_s + request.wait_ms / 1000))

    def _try_grant(self, identity: bytes, peer: Peer, request: protocol.LeaseRequest, now_s: float,
                   final: bool) -> bool:
        """Grant what admission allows; returns False (nothing sent) when nothing is granted and not final."""
        if self.quarantine.status((peer.client_id, peer.session)) is Status.QUARANTINED:
            if final:
                self._send(identity, protocol.LeaseGrant(reason="quarantined", latest_version=self.latest_version))
            return final
        decision = self._admission(identity, peer, request.max_leases)
        if decision.num_leases == 0 and not final and decision.reason not in ("stale_adapter", "draining"):
            return False
        granted: list[Lease] = []
        for _ in range(decision.num_leases):
            lease = self.ledger.grant(identity, now_s)
            if lease is None:
                break
            granted.append(lease)
        reason = decision.reason if len(granted) == decision.num_leases else "no_prompts"
        if not granted and not final and reason not in ("stale_adapter", "draining"):
            return False
        leases = []
        for lease in granted:
            item = self.ledger.source.item(lease.key)
            leases.append(protocol.PromptLease(
                lease_id=lease.lease_id, group_id=group_id_of(lease.key), prompt_index=lease.key[1],
                epoch=lease.key[0], task=self.task_label, group_size=self.group_size,
                deadline_s=self.ledger.leases.timeout_s, **item.lease_fields()))
        peer.num_leases_granted += len(granted)
        self._send(identity, protocol.LeaseGrant(leases=leases, reason=reason, latest_version=self.latest_version),
                   on_fail=lambda: self._return_leases(granted, Reason.UNDELIVERABLE))
        return True

    def _return_malformed_lease(self, identity: bytes, header: dict[str, Any]) -> None:
        """A RolloutGroup that failed its decode: the lease it names, if the sender holds it, goes back at once
        (the worker drops a group the broker refused; waiting for lease_timeout_s would only idle the prompt)."""
        lease = self.ledger.leases.get(header.get("lease_id")) if isinstance(header.get("lease_id"), str) else None
        if lease is not None and lease.worker == identity:
            self._return_leases([lease], Reason.REFUSED)

    def _return_leases(self, leases: list[Lease], reason: Reason) -> None:
        for lease in leases:
            self.ledger.end_lease(lease, reason)

    def _on_lease_return(self, identity: bytes, _peer: Peer, returned: protocol.LeaseReturn, _env: Any,
                         _frames: Any, _now_s: float) -> None:
        unknown = []
        for lease_id in returned.lease_ids:
            lease = self.ledger.leases.get(lease_id)
            if lease is None or lease.worker != identity:
                unknown.append(lease_id)
            else:
                self._return_leases([lease], Reason.RETURNED)
        if unknown:
            self._reject(identity, "unknown_lease", f"lease(s) {unknown[:8]} are not held by you (expired, "
                         "reclaimed or never granted)", ref_kind=Kind.LEASE_RETURN, ref_id=unknown[0])

    # -- rollout groups --------------------------------------------------------------------------------------

    def _on_rollout_group(self, identity: bytes, peer: Peer, group: protocol.RolloutGroup,
                          envelope: framing.Envelope, _frames: Any, now_s: float) -> None:
        key = parse_group_id(group.group_id)
        state = self.ledger.state(key) if key is not None else State.NEW
        if key is None or state == "new":
            self._reject(identity, "unknown_lease", f"group {group.group_id!r} (lease {group.lease_id!r}) was never "
                         "leased by this broker", ref_kind=Kind.ROLLOUT_GROUP, ref_id=group.group_id)
            return
        if not self.ledger.leases.issued_to(group.lease_id, key, identity):
            self._reject(identity, "unknown_lease", f"group {group.group_id!r}: lease {group.lease_id!r} was not "
                         "granted to this client for this prompt (a lease binds the client it was granted to)",
                         ref_kind=Kind.ROLLOUT_GROUP, ref_id=group.group_id, reason="lease_not_yours")
            return
        if self.quarantine.status((peer.client_id, peer.session)) is Status.QUARANTINED:
            self._refuse_group(identity, key, group, "quarantined", f"RolloutGroup {group.group_id}: this worker "
                               "process is quarantined, its rollouts failed the learner's policy check (see "
                               "`loraflow status`; common/integrity.py); fix its engine and restart it")
            return
        if state in ("buffered", "training", "trained"):
            self.stats.count("groups", "duplicate")
            self._ack_group(identity, peer, group.group_id, "duplicate")
            return
        try:
            if group.num_samples != self.group_size:
                raise ProtocolError(f"RolloutGroup {group.group_id}: {group.num_samples} samples, the run's "
                                    f"group_size is {self.group_size} (groups travel whole)", code="invalid_group")
            protocol.check_group_values(group, envelope.specs, envelope.frames, vocab_size=self.vocab_size,
                                        latest_version=self.latest_version)
        except ProtocolError as exc:
            self._refuse_group(identity, key, group, exc.code, str(exc))
            return
        if versions.is_too_stale(self.latest_version, group.min_version, self.max_staleness):
            self.stats.count("dropped", "stale_on_arrival")
            self._refuse_group(identity, key, group, "invalid_group",
                               f"RolloutGroup {group.group_id}: min_version {group.min_version} is more than "
                               f"max_staleness {self.max_staleness} behind version {self.latest_version}; "
                               "the prompt was re-queued", reason="stale")
            return
        if self.history.withdrawn and versions.overlaps(self.history.withdrawn, group.min_version, group.max_version) \
                and versions.touches(self.history.withdrawn, token_versions(envelope.specs, envelope.frames)):
            self.stats.count("dropped", "withdrawn_on_arrival")
            self._refuse_group(identity, key, group, "invalid_group",
                               f"RolloutGroup {group.group_id}: holds tokens of a withdrawn version "
                               f"{self.history.withdrawn} (a restarted learner rolled it back); the prompt was "
                               "re-queued", reason="withdrawn")
            return
        buffer = self.ledger.buffer
        if not buffer.fits(envelope.num_bytes):
            self.stats.count("dropped", "buffer_full")
            self._refuse_group(identity, key, group, "limit",
                               f"RolloutGroup {group.group_id}: {envelope.num_bytes} bytes do not fit the buffer "
                               f"({buffer.memory_bytes} of broker.max_buffer_bytes={buffer.max_bytes} "
                               "used, counting per-group overhead); "
                               "the prompt was re-queued", reason="buffer_full")
            return
        num_tokens = sum(group.completion_lens)
        self.ledger.accept(StoredGroup(group_id=group.group_id, key=key, header=envelope.header,
                                       wire_specs=[s.to_wire() for s in envelope.specs],
                                       frames=envelope.frames, num_bytes=envelope.num_bytes,
                                       min_version=group.min_version, num_tokens=num_tokens, worker=peer.client_id,
                                       session=peer.session, received_s=now_s), group.lease_id)
        weight = 0.1 if self.mean_group_bytes else 1.0
        self.mean_group_bytes += weight * (envelope.num_bytes - self.mean_group_bytes)
        peer.num_groups_accepted += 1
        self.stats.tokens_accepted += num_tokens
        self._ack_group(identity, peer, group.group_id, "accepted")

    def _ack_group(self, identity: bytes, peer: Peer, group_id: str, status: str) -> None:
        """Acknowledge a group: at once, or (a client that reads Ack.ref_ids) with its other groups of this loop
        pass in one Ack per status (:meth:`broker.outbox.Outbox.ack_group`)."""
        if peer.batched_acks:
            self.outbox.ack_group(identity, status, group_id)
        else:
            self._send(identity, protocol.Ack(ref_kind=Kind.ROLLOUT_GROUP, ref_id=group_id, status=status))

    def _refuse_group(self, identity: bytes, key: PromptKey, group: protocol.RolloutGroup, code: str, message: str,
                      reason: str | None = None) -> None:
        """Error for a group that will not be buffered; its prompt goes back to the queue."""
        lease = self.ledger.leases.get(group.lease_id)
        if lease is not None and lease.key == key and lease.worker == identity:
            self._return_leases([lease], Reason.REFUSED)
        # otherwise the prompt is queued already, or leased again to another worker (theirs to deliver)
        log.info("group_refused", group_id=group.group_id, worker=group.worker_id, code=code, reason=reason or code,
                 error=message[:200])
        self._reject(identity, code, message, ref_kind=Kind.ROLLOUT_GROUP, ref_id=group.group_id, reason=reason)

    # -- batches ---------------------------------------------------------------------------------------------

    def _drop_stale(self) -> None:
        if self._stale_checked_version == self.latest_version:
            return
        self._stale_checked_version = self.latest_version
        dropped = self.ledger.drop_stale(self.latest_version, self.max_staleness)
        if dropped:
            log.info("stale_groups_dropped", num_groups=len(dropped), latest_version=self.latest_version,
                     max_staleness=self.max_staleness, requeued=[g.group_id for g in dropped[:8]])

    def _on_batch_request(self, identity: bytes, peer: Peer, request: protocol.BatchRequest, _env: Any,
                          _frames: Any, now_s: float) -> None:
        self.learner_progress["learner_version"] = request.learner_version
        if request.num_groups > self.ledger.buffer.max_groups:
            self._reject(identity, "limit", f"BatchRequest for {request.num_groups} groups can never be filled: the "
                         f"broker holds at most {self.ledger.buffer.max_groups} (broker.capacity_groups)",
                         ref_kind=Kind.BATCH_REQUEST)
            return
        self._drop_stale()
        self.batch_waiters.remove(identity)  # a newer request replaces a parked one (broker.waiters)
        if not self._try_serve(identity, request, final=request.wait_ms == 0):
            self.batch_waiters.park(Waiter(identity=identity, request=request, deadline_s=now_s + request.wait_ms / 1000))

    def _try_serve(self, identity: bytes, request: protocol.BatchRequest, final: bool) -> bool:
        batch_id = f"{self.broker_id}.{self._batch_seq + 1}"
        num_groups = request.num_groups
        buffered = self.ledger.buffer.num_buffered
        if buffered < num_groups and self.ledger.nothing_more_to_come():
            num_groups = buffered  # the dataset's last groups: a short batch, else it never ends
        groups = self.ledger.serve(num_groups, batch_id)
        if groups is None:
            if final:
                self._send(identity, protocol.Batch(latest_version=self.latest_version))
            return final
        self._batch_seq += 1
        entries, specs, frames = [], [], []
        for group in groups:
            self.stats.count("served_staleness", versions.staleness(self.latest_version, group.min_version))
            # the submitting process as the broker knows it, not as the group claims (the learner's lora_id memory)
            entries.append({"group": {**group.header, "worker_id": group.worker, "worker_session": group.session},
                            "first_tensor": len(specs)})
            base = len(frames)
            specs.extend({**spec, "frame": base + spec["frame"]} for spec in group.wire_specs)
            frames.extend(group.frames)
        header = {"batch_id": batch_id, "groups": entries, "latest_version": self.latest_version, "tensors": specs}
        # framing.pack_raw's layout, with the tensor specs kept as wire dicts from the groups' arrival
        message = [framing.PREAMBLE.pack(framing.MAGIC, protocol.PROTOCOL_VERSION, Kind.BATCH),
                   msgpack.packb(header, use_bin_type=True), *frames]
        self.outbox.send(identity, Kind.BATCH, message, on_fail=lambda: self._unserve(batch_id),
                         num_bytes=sum(g.num_bytes for g in groups))
        return True

    def _drop_withdrawn(self) -> None:
        """Take buffered groups holding a withdrawn version's tokens out of the buffer; their prompts re-queued."""
        dropped = [g for g in self.ledger.buffered()
                   if versions.overlaps(self.history.withdrawn, g.min_version, g.header["max_version"])
                   and versions.touches(self.history.withdrawn, token_versions(g.wire_specs, g.frames))]
        self.ledger.drop_buffered(dropped, Reason.WITHDRAWN)
        if dropped:
            log.info("withdrawn_groups_dropped", num_groups=len(dropped), withdrawn=self.history.withdrawn,
                     requeued=[g.group_id for g in dropped[:8]])

    def _unserve(self, batch_id: str) -> None:
        if self.ledger.unserve(batch_id):
            self._stale_checked_version = -1  # restored groups may have aged while in training: check again

    def _on_batch_ack(self, identity: bytes, _peer: Peer, ack: protocol.BatchAck, _env: Any, _frames: Any,
                      now_s: float) -> None:
        listed = set(ack.group_ids)
        failed = {m.group_id: m for m in ack.mismatches}
        if self.ledger.buffer.batch(ack.batch_id) is None and not listed:
            self._reject(identity, "unknown_batch", f"batch {ack.batch_id!r} is unknown to this broker and the ack "
                         "lists no group_ids", ref_kind=Kind.BATCH_ACK, ref_id=ack.batch_id)
            return
        # the list is authoritative: unlisted = not trained
        settled = self.ledger.settle(ack.batch_id, listed, set(failed)) or []
        num_trained = 0
        for mismatch in ack.mismatches:
            self.stats.count("policy_mismatches", mismatch.reason)
        for group, trained in settled:
            if trained:
                num_trained += 1
                self.history.record(group.key, ack.trained_version)
            if group.group_id in failed or trained:
                self._checked(group, failed.get(group.group_id), now_s)
        served = {g.group_id for g, _ in settled}
        for group_id in listed - served:
            num_trained += self._mark_trained(group_id, ack.trained_version)
        self.num_trained_total += num_trained
        self.num_trained_since_start += num_trained
        self.history.commit(ack.checkpoint_version)
        self.learner_progress.update(step=ack.step, trained_version=ack.trained_version,
                                     checkpoint_version=ack.checkpoint_version)
        self._send(identity, protocol.Ack(ref_kind=Kind.BATCH_ACK, ref_id=ack.batch_id), after_persist=True)

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
        row = self.quarantine.row(worker, now_s, self.started_unix + (now_s - self.started_s))
        log.warning("worker_quarantined", worker=worker[0], session=worker[1], connected=peer is not None,
                    num_failed=row["num_failed"], num_checked=row["num_checked"],
                    num_quarantines=row["num_quarantines"], dropped=len(dropped), leases_returned=len(leases),
                    evidence=[{k: e[k] for k in ("group_id", "reason", "version", "num_off", "num_checked",
                                                 "max_abs_diff", "detail")} for e in row["evidence"]])
        self._reconsider = True

    def _worker_joined(self, peer: Peer, now_s: float) -> None:
        """A worker's Hello: the restart of a quarantined process starts on probation."""
        if self.quarantine.rejoin(peer.client_id, peer.session, now_s):
            self.stats.count("quarantines", "probation")
            log.warning("worker_on_probation", worker=peer.client_id, session=peer.session,
                        why="a new process of a quarantined worker: one lease at a time until a group passes")

    def _mark_trained(self, group_id: str, trained_version: int) -> int:
        """A group trained from a batch this broker did not serve (it restarted); 1 if it was pending."""
        key = parse_group_id(group_id)
        if key is None or not self.ledger.mark_trained(key):
            return 0
        self.history.record(key, trained_version)
        return 1

    def _answer_lease_waiter(self, waiter: Waiter, now_s: float, final: bool) -> bool:
        peer = self.peers.get(waiter.identity)
        if peer is None:
            return True
        return self._try_grant(waiter.identity, peer, waiter.request, now_s, final)

    def _answer_batch_waiter(self, waiter: Waiter, _now_s: float, final: bool) -> bool:
        return self._try_serve(waiter.identity, waiter.request, final)
