"""Who is connected: Hellos, Byes and deaths, the one learner, and what a restarted learner takes back.

    Hello (worker)  -> registered (loraflow.broker.peers; a new session of a known client id: the old process's leases
                       reclaimed) -> a quarantined worker's restart on probation -> Welcome (+ AdapterNotice of
                       the newest version when it is behind)
    Hello (learner) -> the run token (security off) -> registered; any other learner fenced (refused
                       ``replaced`` from then on) -> a learner of another session than the history's: rollback
                       (below) -> Welcome after the state write that makes the rollback durable
    Bye / silence   -> what the client held taken back: leases re-queued, a learner's batches back to the buffer

A restarted learner resumed from a checkpoint of version v = ``Hello.adapter_version``: groups trained on
parameters of version >= v are re-queued; versions v+1..latest are withdrawn (dropped from the adapter cache;
buffered groups holding their tokens dropped and re-queued; arriving ones refused; workers holding one get no
lease until they load a newer version) (:mod:`loraflow.broker.history`). The resumed learner publishes its weights as
latest+1 right away.
"""

from __future__ import annotations

import hmac

from loraflow.broker.adapters import AdapterRelay
from loraflow.broker.batching import BatchDesk
from loraflow.broker.history import RunProgress, TrainingHistory
from loraflow.broker.leasing import LeaseDesk
from loraflow.broker.ledger import GroupLedger, Reason
from loraflow.broker.outbox import Outbox
from loraflow.broker.peers import ClientIdTaken, Peer, PeerRegistry, RegistryFull
from loraflow.broker.quarantine import Quarantine
from loraflow.broker.stats import BrokerStats
from loraflow.common import protocol
from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Kind

log = get_logger("broker")


class Registrar:
    """Registration and departure of clients, and the learner's restarts (see the module docstring)."""

    def __init__(self, config: Config, *, broker_id: str, vocab_size: int, run_token: str | None,
                 peers: PeerRegistry, quarantine: Quarantine, history: TrainingHistory, ledger: GroupLedger,
                 progress: RunProgress, relay: AdapterRelay, leasing: LeaseDesk, batching: BatchDesk,
                 outbox: Outbox, stats: BrokerStats) -> None:
        self.config, self.broker_id, self.vocab_size, self.run_token = config, broker_id, vocab_size, run_token
        self.peers, self.quarantine, self.history, self.ledger = peers, quarantine, history, ledger
        self.progress, self.relay, self.leasing, self.batching = progress, relay, leasing, batching
        self.outbox, self.stats = outbox, stats

    def refusal(self, hello: protocol.Hello) -> tuple[str, str, str] | None:
        """(code, message, reason) when a Hello is refused before anything is registered."""
        if hello.role == "learner" and self.run_token and not hmac.compare_digest(hello.token.encode(),
                                                                                  self.run_token.encode()):
            return "forbidden", ("a learner's Hello needs the run token (security off, or a pool run): the learner "
                                 "reads it from security.run_token_file (default <run_dir>/broker/run_token, written by the "
                                 "broker) or security.run_token; give it the broker's"), "run_token"
        return None

    def hello(self, identity: bytes, old_peer: Peer | None, hello: protocol.Hello, now_s: float,
              key: str | None) -> None:
        """Register the sender and welcome it (the refusals of a full registry or a taken client id come before
        anything is registered: :meth:`loraflow.broker.peers.PeerRegistry.hello` raises first)."""
        try:
            peer, replaced = self.peers.hello(identity, hello, now_s, key=key)
        except RegistryFull as exc:
            self.outbox.reject(identity, "limit", str(exc), ref_kind=Kind.HELLO)
            return
        except ClientIdTaken as exc:
            self.outbox.reject(identity, "forbidden", str(exc), ref_kind=Kind.HELLO, reason="client_id_taken")
            return
        if replaced is not None:
            log.info("peer_restarted", peer=peer.name, old_session=replaced.session, session=peer.session)
            self.gone(replaced, "restarted")
        if peer.role == "worker" and self.quarantine.rejoin(peer.client_id, peer.session, now_s):
            self.stats.count("quarantines", "probation")
            log.warning("worker_on_probation", worker=peer.client_id, session=peer.session,
                        why="a new process of a quarantined worker: one lease at a time until a group passes")
        if peer.role == "learner":
            for other in self.peers.of_role("learner"):
                if other.identity != identity:
                    self._fence(other, peer)
                    self.gone(other, "replaced")
            if replaced is not None and replaced.identity != identity:  # the same client id on another route
                self._fence(replaced, peer)
        restarted = peer.role == "learner" and hello.session != self.history.learner_session
        if restarted:
            self._learner_restarted(hello, now_s)  # its Welcome waits until the rollback is durable
        broker, run = self.config.broker, self.config.run
        self.outbox.send_record(identity, protocol.Welcome(
            broker_id=self.broker_id, latest_version=self.progress.latest_version, group_size=run.group_size,
            groups_per_step=run.groups_per_step, max_staleness=run.max_staleness,
            heartbeat_interval_s=self.peers.interval_s, heartbeat_timeout_s=self.peers.timeout_s,
            lease_timeout_s=broker.lease_timeout_s, max_message_bytes=broker.max_message_bytes,
            vocab_size=self.vocab_size), after_durable=restarted)
        if peer.role == "worker":
            self.relay.notify_behind(identity, hello.adapter_version)
        if replaced is not None or old_peer is None:
            log.info("peer_joined", peer=peer.name, role=peer.role, session=peer.session, host=peer.host,
                     pid=peer.pid, adapter_version=peer.adapter_version)

    def _fence(self, old: Peer, successor: Peer) -> None:
        """``old`` was replaced by the learner ``successor``: its identity is refused from now on, and it is told."""
        self.peers.fence(old, successor)
        log.warning("learner_replaced", old=old.name, old_session=old.session, new_session=successor.session,
                    new_host=successor.host, new_pid=successor.pid)
        self.outbox.reject(old.identity, "replaced", self.fenced_message(old.identity), ref_kind=Kind.HELLO)

    def fenced_message(self, identity: bytes) -> str:
        return (f"this learner was replaced by another learner process, {self.peers.fenced_by(identity)}, that "
                "connected to the same broker; it must stop so that two learners never train one run (to run this "
                "one instead, stop the other and start this one again)")

    def _learner_restarted(self, hello: protocol.Hello, now_s: float) -> None:
        """A learner process that is not the one whose steps the history holds: it resumed from a checkpoint of
        version ``hello.adapter_version`` (see the module docstring)."""
        resumed, latest = hello.adapter_version, self.progress.latest_version
        lost = self.history.rollback(resumed)
        self.progress.trained(-sum(self.ledger.roll_back(key) for key in lost))
        self.stats.count("groups", "rolled_back", len(lost))
        if resumed < latest and self.history.withdraw(resumed + 1, latest):
            self.relay.withdraw(resumed + 1, latest)
            self.progress.base_version += latest - resumed  # the admission limit counts versions trained
            self.batching.drop_withdrawn()
            self.leasing.answer_stale(now_s)
        self.history.learner_session = hello.session
        log.info("learner_restarted", session=hello.session, resumed_version=resumed, latest_version=latest,
                 requeued=len(lost), withdrawn=self.history.withdrawn)

    def bye(self, identity: bytes, peer: Peer, bye: protocol.Bye) -> None:
        self.peers.remove(identity)
        log.info("peer_left", peer=peer.name, reason=bye.reason)
        self.gone(peer, "bye")

    def dead(self, now_s: float) -> int:
        """Clients silent for heartbeat_misses intervals are gone; how many. (The heartbeat interval asked of the
        fleet is set for its size first: loraflow.broker.peers, "The heartbeat budget".)"""
        if self.peers.pace(now_s):
            log.info("heartbeat_interval_set", interval_s=self.peers.interval_s, timeout_s=self.peers.timeout_s,
                     clients=len(self.peers), max_heartbeats_per_second=self.peers.max_heartbeats_per_second)
        dead = self.peers.dead(now_s)
        for peer in dead:
            log.warning("peer_dead", peer=peer.name, silent_s=round(now_s - peer.last_seen_s, 2))
            self.gone(peer, "dead")
        return len(dead)

    def gone(self, peer: Peer, why: str) -> None:
        """Take back what a dead, departed or restarted client held."""
        self.ledger.end_leases_of(peer.identity, Reason.RECLAIMED)
        if peer.role == "learner":
            self.batching.learner_gone()
        self.leasing.waiters.remove(peer.identity)
        self.batching.waiters.remove(peer.identity)
        self.stats.count("peers_gone", why)
