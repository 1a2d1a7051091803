"""Lease requests: credit-based admission, grants from the ledger, and the parked long-polls.

    LeaseRequest -> quarantined? -> admission.decide -> GroupLedger.grant x n -> LeaseGrant (or park / wait)

A request that cannot be granted anything now is parked (:class:`loraflow.broker.outbox.WaiterQueue`, one per worker)
and answered when the state changes (the core calls :meth:`LeaseDesk.serve_waiters` after every ledger
transition or change of version) or, empty with the reason, at its deadline. Some reasons are answered at
once, never parked: ``stale_adapter`` (fetch the newest adapter first) and ``draining``. A process that is
quarantined (:mod:`loraflow.broker.quarantine`) gets ``LeaseGrant(reason="quarantined")`` at its deadline; one on
probation holds one lease at a time. A LeaseGrant zmq refuses to send ends its leases (``undeliverable``).
"""

from __future__ import annotations

from loraflow.broker import admission
from loraflow.broker.history import RunProgress, TrainingHistory
from loraflow.broker.ledger import GroupLedger, Reason
from loraflow.broker.outbox import Outbox, Waiter, WaiterQueue
from loraflow.broker.peers import Peer, PeerRegistry
from loraflow.broker.prompts import Lease, group_id_of
from loraflow.broker.quarantine import Quarantine, Status
from loraflow.common import protocol, versions
from loraflow.common.config import Config

ANSWERED_AT_ONCE = ("stale_adapter", "draining")  # reasons a request is never parked for


class LeaseDesk:
    """Admission and grants for LeaseRequests, and their parked long-polls."""

    def __init__(self, config: Config, *, ledger: GroupLedger, peers: PeerRegistry, quarantine: Quarantine,
                 history: TrainingHistory, progress: RunProgress, outbox: Outbox, task_label: str) -> None:
        run = config.run
        self.group_size = run.group_size
        self.max_staleness = run.max_staleness
        self.groups_per_version = run.groups_per_step * config.learner.publish_every
        self.capacity_groups = config.capacity_groups
        self.max_leases_per_worker = config.broker.max_leases_per_worker
        self.task_label = task_label
        self.ledger, self.peers, self.quarantine, self.history = ledger, peers, quarantine, history
        self.progress, self.outbox = progress, outbox
        self.waiters = WaiterQueue()

    # -- admission -------------------------------------------------------------------------------------------

    @property
    def mean_group_footprint(self) -> float:
        """Mean bytes a group is charged in the buffer (0 before the first group)."""
        mean = self.progress.mean_group_bytes
        return mean + self.ledger.buffer.group_overhead_bytes if mean else 0.0

    def _inputs(self, worker_version: int, worker_leases: int, requested: int,
                max_leases_per_worker: int) -> admission.AdmissionInputs:
        ledger, progress = self.ledger, self.progress
        return admission.AdmissionInputs(
            requested=requested, worker_version=worker_version, latest_version=progress.latest_version,
            max_staleness=self.max_staleness, groups_per_step=self.groups_per_version,
            capacity_groups=self.capacity_groups, num_leased=ledger.num_leased, num_stored=ledger.num_held,
            num_trained_groups=progress.num_trained_since_start, base_version=progress.base_version,
            worker_leases=worker_leases, max_leases_per_worker=max_leases_per_worker,
            stored_bytes=ledger.buffer.memory_bytes, mean_group_bytes=self.mean_group_footprint,
            max_buffer_bytes=ledger.buffer.max_bytes, prompts_available=ledger.available(requested),
            draining=progress.draining, worker_withdrawn=self.history.is_withdrawn(worker_version))

    def credit(self) -> int:
        """Groups any up-to-date worker could be leased now (capacity, admission limit, byte bound)."""
        return admission.credit(self._inputs(self.progress.latest_version, 0, 0, self.max_leases_per_worker))

    def _status(self, peer: Peer) -> Status:
        return self.quarantine.status((peer.client_id, peer.session))

    # -- requests --------------------------------------------------------------------------------------------

    def request(self, identity: bytes, peer: Peer, request: protocol.LeaseRequest, now_s: float) -> None:
        """A LeaseRequest: granted now, or parked until something can be granted or its deadline."""
        peer.adapter_version = request.adapter_version
        self.waiters.remove(identity)  # a newer request replaces a parked one (loraflow.broker.outbox.WaiterQueue)
        if not self.try_grant(identity, peer, request, now_s, final=request.wait_ms == 0):
            self.waiters.park(Waiter(identity=identity, request=request, deadline_s=now_s + request.wait_ms / 1000))

    def try_grant(self, identity: bytes, peer: Peer, request: protocol.LeaseRequest, now_s: float,
                  final: bool) -> bool:
        """Grant what admission allows; returns False (nothing sent) when nothing is granted and not final."""
        latest = self.progress.latest_version
        status = self._status(peer)
        if status is Status.QUARANTINED:
            if final:
                self.outbox.send_record(identity, protocol.LeaseGrant(reason="quarantined", latest_version=latest))
            return final
        per_worker = 1 if status is Status.PROBATION else self.max_leases_per_worker
        decision = admission.decide(self._inputs(peer.adapter_version, self.ledger.leases.count(identity),
                                                 request.max_leases, per_worker))
        if decision.num_leases == 0 and not final and decision.reason not in ANSWERED_AT_ONCE:
            return False
        granted: list[Lease] = []
        for _ in range(decision.num_leases):
            lease = self.ledger.grant(identity, now_s)
            if lease is None:
                break
            granted.append(lease)
        reason = decision.reason if len(granted) == decision.num_leases else "no_prompts"
        if not granted and not final and reason not in ANSWERED_AT_ONCE:
            return False
        leases = [protocol.PromptLease(
            lease_id=lease.lease_id, group_id=group_id_of(lease.key), prompt_index=lease.key[1], epoch=lease.key[0],
            task=self.task_label, group_size=self.group_size, deadline_s=self.ledger.leases.timeout_s,
            **self.ledger.source.item(lease.key).lease_fields()) for lease in granted]
        peer.num_leases_granted += len(granted)
        self.outbox.send_record(identity, protocol.LeaseGrant(leases=leases, reason=reason, latest_version=latest),
                                on_fail=lambda: self.end(granted, Reason.UNDELIVERABLE))
        return True

    def end(self, leases: list[Lease], reason: Reason) -> None:
        """End these leases (those still live), their prompts re-queued."""
        for lease in leases:
            self.ledger.end_lease(lease, reason)

    def give_back(self, identity: bytes, lease_ids: list[str]) -> list[str]:
        """A LeaseReturn: the listed leases ``identity`` holds end; returns the ids it does not hold."""
        unknown = []
        for lease_id in lease_ids:
            lease = self.ledger.leases.get(lease_id)
            if lease is None or lease.worker != identity:
                unknown.append(lease_id)
            else:
                self.ledger.end_lease(lease, Reason.RETURNED)
        return unknown

    # -- parked requests -------------------------------------------------------------------------------------

    def answer(self, waiter: Waiter, now_s: float, final: bool) -> bool:
        peer = self.peers.get(waiter.identity)
        if peer is None:
            return True
        return self.try_grant(waiter.identity, peer, waiter.request, now_s, final)

    def serve_waiters(self, now_s: float) -> None:
        """Grant parked lease requests in arrival order while there is credit and something to lease."""
        if not self.waiters or self.progress.draining:
            return
        for waiter in self.waiters:
            if not (self.credit() > 0 and self.ledger.available(1) > 0):
                return
            if self.answer(waiter, now_s, final=False):
                self.waiters.remove(waiter.identity)

    def answer_stale(self, now_s: float) -> None:
        """After a new or withdrawn version: parked requests of workers now too far behind, or holding a withdrawn
        version, get "stale_adapter" at once."""
        latest = self.progress.latest_version
        for waiter in self.waiters:
            peer = self.peers.get(waiter.identity)
            if peer is not None and (self.history.is_withdrawn(peer.adapter_version) or not versions.worker_may_generate(
                    peer.adapter_version, latest, self.max_staleness)):
                self.waiters.remove(waiter.identity)
                self.try_grant(waiter.identity, peer, waiter.request, now_s, final=True)

    def expire_waiters(self, now_s: float) -> None:
        for waiter in self.waiters.expired(now_s):
            self.answer(waiter, now_s, final=True)

    def drain(self, now_s: float) -> None:
        """Shutting down: every parked request answered (empty, draining)."""
        for waiter in self.waiters:
            self.answer(waiter, now_s, final=True)
        self.waiters.clear()
