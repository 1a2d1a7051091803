"""The broker's state machine: what each message does to the prompts, leases, buffer, adapters and peers.

This module holds dispatch, registration and liveness, the adapter relay, persistence, timers and flushing;
the work-moving handlers (leases, groups, batches) are in :mod:`broker.flow`.

:class:`BrokerCore` owns no socket. :mod:`broker.server` hands it every received multipart message
(``handle(identity, frames, now_s)``), calls ``tick`` for timers and ``flush`` for what to send; each
:class:`Outgoing` carries an ``on_fail`` undo for when zmq refuses it (the peer is gone or its queue is
full): undeliverable leases go back to the queue, an undeliverable batch goes back to the buffer.

Per message, in order: framing checks (size, protocol version, header) -> who may send it (unknown identities
may only say Hello or ask for Stats; roles are checked per kind) -> the record's validating decode -> the
handler. Every refusal is an Error reply plus ``rejected{reason}``; nothing a peer sends can raise out of
:meth:`BrokerCore.handle` short of a bug.

Semantics (the contract between roles, see the team plan):

- LeaseRequest / BatchRequest are long-polls: answered at once when something can be given, else parked as a
  *waiter* and answered when state changes (a ledger transition, or ``_reconsider``) or with an empty reply at its deadline.
- RolloutGroup: only for a lease granted to the sender for that prompt (lease ids carry a MAC binding them to
  their holder, :mod:`broker.leases`; else ``unknown_lease`` and nobody's lease is touched); dedup by group id
  (buffered/training/trained -> Ack duplicate); a group for a prompt whose lease expired is still accepted
  (and any newer lease on it cancelled); malformed, invalid, too stale or over the byte bound -> Error and the
  sender's lease on the prompt is returned at once (the prompt re-queued).
- BatchAck: the listed groups are trained (none listed = the whole batch); a batch's unlisted groups are
  re-queued; an unknown batch id (a restarted broker) marks the listed ids trained. The Ack is sent only
  after the state file is written (one write for all acks handled in one loop pass: group commit).
- AdapterUpdate: version must exceed the latest (or equal it, with the same sha256, when this broker lost the
  frames in a restart; a withdrawn version never comes back); Ack after the state write, then an
  AdapterNotice to every worker. Workers saying Hello with an older version get an AdapterNotice of the
  newest right after their Welcome and fetch it (AdapterFetch) when they want it.
- Hello from a learner, with security off, must carry the run token (``Hello.token``, :mod:`common.run_token`)
  or is refused ``forbidden``; with CURVE the learner role is bound to learner keys instead.
- Hello from a learner of another session than the one the training history belongs to (it restarted, and
  resumed from a checkpoint of version v = ``Hello.adapter_version``): groups trained on parameters of version
  >= v are re-queued, versions v+1..latest are withdrawn (dropped from the adapter cache; buffered groups
  holding their tokens dropped and re-queued; arriving ones refused; workers holding one get no lease until
  they load a newer version), and its Welcome waits for the state write that makes this durable
  (:mod:`broker.history`). The resumed learner publishes its weights as latest+1 right away.
"""

from __future__ import annotations

import hmac
import secrets
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from broker.adapters import AdapterCache
from broker.buffer import RolloutBuffer
from broker.flow import DataFlow
from broker.history import TrainingHistory
from broker.leases import LeaseTable
from broker.ledger import GroupLedger, Reason
from broker.outbox import KIND_NAMES, Outbox, Outgoing
from broker.peers import ClientIdTaken, Peer, PeerRegistry, RegistryFull, display_name
from broker.prompts import PromptSource, group_id_of
from broker.quarantine import Quarantine, Status
from broker.snapshot import build_snapshot
from broker.state import BrokerState, StateWriter, check_matches, load_adapter, load_state, make_state
from broker.stats import BrokerStats
from broker.waiters import WaiterQueue
from common import framing, protocol
from common.config import Config
from common.logging import get_logger
from common.protocol import Kind, ProtocolError
from common.tasks import Task

log = get_logger("broker")

ANYONE = frozenset({"worker", "learner", "observer"})
#: who may send each kind; None = also unregistered identities; kinds missing here only the broker sends
SENDERS: dict[int, frozenset[str] | None] = {
    Kind.HELLO: None,
    Kind.STATS_REQUEST: None,
    Kind.HEARTBEAT: ANYONE,
    Kind.BYE: ANYONE,
    Kind.LEASE_REQUEST: frozenset({"worker"}),
    Kind.LEASE_RETURN: frozenset({"worker"}),
    Kind.ROLLOUT_GROUP: frozenset({"worker"}),
    Kind.ADAPTER_FETCH: frozenset({"worker", "learner"}),
    Kind.ADAPTER_UPDATE: frozenset({"learner"}),
    Kind.BATCH_REQUEST: frozenset({"learner"}),
    Kind.BATCH_ACK: frozenset({"learner"}),
}
PEER_CHECK_FRACTION = 0.5  # check liveness every half heartbeat interval
STATS_TICK_S = 1.0
RESERVE_BLOCK = 4096  # new prompt keys handed out per state-file write (re-queued, not lost, after a crash)


def _peek_kind(frames: list[Any]) -> int:
    try:
        magic, _, kind = framing.PREAMBLE.unpack(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
    except Exception:  # anything that is not a preamble
        return 0
    return kind if magic == framing.MAGIC and 0 < kind < 1 << 16 else 0


def _nbytes(frames: list[Any]) -> int:
    return sum(len(f) for f in frames)


class BrokerCore(DataFlow):
    """Prompts, leases, buffer, adapters, peers and stats, driven by messages and the clock."""

    def __init__(self, config: Config, *, task: Task, vocab_size: int = 0, state_path: str | Path | None = None,
                 now_s: float | None = None, run_token: str | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        run, broker = config.run, config.broker
        self.config = config
        self.broker_id = uuid.uuid4().hex[:12]
        self.vocab_size = vocab_size
        self.group_size = run.group_size
        self.max_staleness = run.max_staleness
        self.groups_per_version = run.groups_per_step * config.learner.publish_every
        self.capacity_groups = config.capacity_groups
        self.task_label = run.task if len(run.task) <= 128 else Path(run.task).name[-128:]
        self.state_path = Path(state_path) if state_path else None
        self.run_token = run_token  # a learner's Hello must carry it (security off; common/run_token.py); None: not checked
        self.started_s, self.started_unix = now_s, time.time()

        self.stats = BrokerStats()
        self.peers = PeerRegistry(heartbeat_interval_s=broker.heartbeat_interval_s,
                                  heartbeat_misses=broker.heartbeat_misses, max_workers=broker.max_workers,
                                  max_observers=broker.max_observers)
        self.adapters = AdapterCache(broker.num_adapters_kept)
        integrity = config.integrity
        self.quarantine = Quarantine(after=integrity.quarantine_after, window=integrity.quarantine_window)
        self.latest_version = 0
        self.num_trained_total = 0  # over the run's lifetime (persisted)
        self.num_trained_since_start = 0  # for the admission limit, counted from base_version
        self.mean_group_bytes = 0.0
        self.draining = False
        self.learner_progress: dict[str, int] = {}

        self.latest_sha256 = ""
        learner = config.learner
        self.history = TrainingHistory(max_records=(2 * learner.checkpoint_every * run.groups_per_step
                                                    + self.capacity_groups) if learner.checkpoint_every else 0)
        self.writer = (StateWriter(self.state_path, min_interval_s=config.broker.state_write_interval_ms / 1000)
                       if self.state_path else None)
        self._unsaved_adapter: tuple[int, list[Any]] | None = None
        self.lease_secret = secrets.token_hex(32)  # the persisted one, if any, replaces it in _restore
        self.ledger = self._restore(task)
        self.base_version = self.latest_version
        self.ledger.source.on_reserve = lambda _end: self.persist()

        self._handlers = {kind: getattr(self, f"_on_{KIND_NAMES[kind]}") for kind in SENDERS if kind != Kind.HELLO}
        self.lease_waiters = WaiterQueue()
        self.batch_waiters = WaiterQueue()
        self.outbox = Outbox(self.stats)
        # a change outside the ledger (a peer, a version) that may let a parked long-poll be answered; the
        # ledger's own transitions count by themselves (GroupLedger.num_changes)
        self._reconsider = False
        self._changes_seen = 0
        self._batch_seq = 0
        self._num_changes = 0  # messages (other than StatsRequest) and ticks handled: what a Stats reply is of
        self._stats_reply: tuple[int, list[Any]] | None = None  # (_num_changes, encoded Stats) of the last one
        self._stale_checked_version = -1
        self._next_peer_check_s = now_s
        self._next_stats_s = now_s
        self.persist()

    # -- persistence -----------------------------------------------------------------------------------------

    def _restore(self, task: Task) -> GroupLedger:
        """The ledger, latest version, trained count and newest adapter as the last process left them."""
        broker, run = self.config.broker, self.config.run
        source = partial(PromptSource, task, prompt_limit=broker.prompt_limit, num_epochs=broker.num_epochs,
                         reserve_block=max(RESERVE_BLOCK, 4 * self.capacity_groups))
        persisted = load_state(self.state_path) if self.state_path else None
        if persisted is not None:
            check_matches(persisted, task=run.task, seed=run.seed, epoch_size=source().epoch_size,
                          path=str(self.state_path))
            self.latest_version, self.latest_sha256 = persisted.latest_version, persisted.latest_sha256
            self.num_trained_total = persisted.num_trained_groups
            self.lease_secret = persisted.lease_secret or self.lease_secret
            self.history = TrainingHistory(max_records=self.history.max_records,
                                           learner_session=persisted.learner_session,
                                           uncommitted=persisted.uncommitted_records(),
                                           withdrawn=persisted.withdrawn_ranges())
        if self.writer is not None:
            self._restore_adapter(self.writer.adapter_path)
        parts = dict(buffer=RolloutBuffer(max_groups=self.capacity_groups, max_bytes=broker.max_buffer_bytes),
                     leases=LeaseTable(timeout_s=broker.lease_timeout_s, max_per_worker=broker.max_leases_per_worker,
                                       id_prefix=f"{self.broker_id[:6]}.", secret=bytes.fromhex(self.lease_secret)),
                     count=self.stats.count)
        if persisted is None:
            return GroupLedger(source(), **parts)
        ledger = GroupLedger.restored(source, cursor=persisted.cursor_key, reserved_until=persisted.reserved_key,
                                      pending=persisted.pending_keys(), num_epochs=broker.num_epochs, **parts)
        log.info("state_restored", path=str(self.state_path), cursor=list(persisted.reserved_key),
                 requeued=ledger.num_queued, latest_version=self.latest_version)
        return ledger

    def _restore_adapter(self, path: Path) -> None:
        """Serve the adapter saved by the previous process (it may be one version ahead of the state file)."""
        frames = load_adapter(path)
        if frames is None:
            return
        update, envelope = protocol.decode(frames)
        if not isinstance(update, protocol.AdapterUpdate):
            raise ValueError(f"{path} holds a {type(update).__name__}, not an AdapterUpdate; move it away")
        if self.history.is_withdrawn(update.version) or update.version < self.latest_version:
            log.info("adapter_not_restored", version=update.version, path=str(path),
                     why="withdrawn" if self.history.is_withdrawn(update.version) else "older than the state")
            return
        self.adapters.add(update, envelope.specs, frames)
        self.latest_version, self.latest_sha256 = update.version, update.sha256.lower()
        log.info("adapter_restored", version=update.version, path=str(path))

    def _state(self) -> BrokerState:
        prompts = self.ledger.source
        return make_state(
            task=self.config.run.task, seed=self.config.run.seed, epoch_size=prompts.epoch_size,
            cursor=prompts.cursor, reserved_until=prompts.reserved_until,
            pending=self.ledger.pending_keys(), latest_version=self.latest_version,
            num_trained_groups=self.num_trained_total, latest_sha256=self.latest_sha256,
            learner_session=self.history.learner_session, uncommitted=self.history.uncommitted.items(),
            withdrawn=self.history.withdrawn, lease_secret=self.lease_secret)

    def persist(self) -> None:
        """Write the state file now, in this thread (start, reserved block, shutdown)."""
        if self.writer is not None:
            adapter, self._unsaved_adapter = self._unsaved_adapter, None
            self.writer.write(self._state(), adapter)
            self.stats.count("state_writes", "sync")

    def _submit_write(self) -> None:
        """Hand the current state to the background writer; replies waiting for it go out once it is durable."""
        if self.writer is None:
            self.outbox.written(None)
            return
        adapter, self._unsaved_adapter = self._unsaved_adapter, None
        self.outbox.written(self.writer.submit(self._state(), adapter))
        self.stats.count("state_writes", "background")

    def _durable_seq(self) -> int:
        return self.writer.durable_seq if self.writer is not None else 0

    # -- sending ---------------------------------------------------------------------------------------------

    def _send(self, identity: bytes, record: Any, on_fail: Callable[[], None] | None = None,
              after_persist: bool = False) -> None:
        self.outbox.send_record(identity, record, on_fail=on_fail, after_durable=after_persist)

    def _reject(self, identity: bytes, code: str, message: str, *, ref_kind: int = 0, ref_id: str = "",
                reason: str | None = None) -> None:
        self.stats.count("rejected", reason or code)
        peer = self.peers.get(identity)
        if peer is not None and ref_kind == Kind.ROLLOUT_GROUP:
            peer.num_groups_rejected += 1
        log.debug("rejected", peer=display_name(identity)[:64], code=code, error=message[:300])
        if ref_kind == Kind.ERROR:
            return  # never answer an error with an error
        self._send(identity, protocol.Error(code=code, message=message[:4000], ref_kind=ref_kind,
                                            ref_id=ref_id[:protocol.MAX_ID_LEN]))

    def internal_error(self, identity: bytes, frames: list[Any]) -> None:
        """A handler raised (a bug): answer ``internal`` so the peer is not left waiting."""
        self._reject(identity, "internal", "the broker failed to handle this message (see its log)",
                     ref_kind=_peek_kind(frames))

    def has_work(self) -> bool:
        """Something to send, write or re-evaluate without waiting for a message."""
        return (self._reconsider or self.ledger.num_changes != self._changes_seen
                or self.outbox.has_ready(self._durable_seq()))

    def send_failed(self, out: Outgoing, reason: str) -> None:
        """zmq refused ``out`` (server calls this); undo what the message promised."""
        self.stats.count("send_failed", reason)
        log.info("send_failed", peer=display_name(out.identity)[:64], kind=KIND_NAMES.get(out.kind),
                 reason=reason)
        self.outbox.failed(out)  # its undo is a ledger transition: parked long-polls are reconsidered

    # -- receiving -------------------------------------------------------------------------------------------

    def handle(self, identity: bytes, frames: list[Any], now_s: float, authenticated_role: str | None = None,
               authenticated_key: str | None = None) -> None:
        """One received message (the frames after the identity). ``authenticated_role`` is the role CURVE
        authentication bound to the sender's key (None without security): a client may act only in that role;
        ``authenticated_key`` names that key (``<role>:<name>``): a client id belongs to the key that registered
        it (:meth:`broker.peers.PeerRegistry.hello`)."""
        try:
            envelope = protocol.decode_envelope(frames, self.config.broker.max_message_bytes)
        except ProtocolError as exc:
            self.stats.bytes_in += _nbytes(frames)
            self.stats.count("messages_in", "undecodable")
            self._num_changes += 1
            self._reject(identity, exc.code, str(exc), ref_kind=_peek_kind(frames))
            return
        kind = envelope.kind
        if kind != Kind.STATS_REQUEST:
            self._num_changes += 1
        self.stats.bytes_in += envelope.num_bytes
        self.stats.count("messages_in", KIND_NAMES[kind])
        if self.peers.fenced_by(identity) is not None:
            self._reject(identity, "replaced", self._fenced_message(identity), ref_kind=kind)
            return
        peer = self.peers.heard(identity, now_s)
        if kind not in SENDERS:
            self._reject(identity, "forbidden", f"{KIND_NAMES[kind]} messages are sent by the broker, not to it",
                         ref_kind=kind)
            return
        allowed = SENDERS[kind]
        if authenticated_role is not None:
            claimed = envelope.header.get("role") if kind == Kind.HELLO else (peer.role if peer else None)
            if claimed is not None and claimed != authenticated_role:
                self._reject(identity, "forbidden", f"this key is authorised as a {authenticated_role}, not as a "
                             f"{claimed} (see `loraflow keys`)", ref_kind=kind)
                return
        if allowed is not None:
            if peer is None:
                self._reject(identity, "not_registered", f"say Hello before sending {KIND_NAMES[kind]}",
                             ref_kind=kind)
                return
            if peer.role not in allowed:
                self._reject(identity, "forbidden", f"a {peer.role} may not send {KIND_NAMES[kind]} "
                             f"(only {', '.join(sorted(allowed))})", ref_kind=kind)
                return
        try:
            record = protocol.decode_record(envelope)
        except ProtocolError as exc:
            if kind == Kind.ROLLOUT_GROUP:
                self._return_malformed_lease(identity, envelope.header)
            ref_id = envelope.header.get("group_id", "")
            self._reject(identity, exc.code, str(exc), ref_kind=kind, ref_id=ref_id if isinstance(ref_id, str) else "")
            return
        if kind == Kind.HELLO:
            self._on_hello(identity, peer, record, now_s, key=authenticated_key)
            return
        self._handlers[kind](identity, peer, record, envelope, frames, now_s)

    # -- registration and liveness ---------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, _peer: Peer | None, hello: protocol.Hello, now_s: float,
                  key: str | None = None) -> None:
        if hello.role == "learner" and self.run_token and not hmac.compare_digest(hello.token.encode(),
                                                                                  self.run_token.encode()):
            self._reject(identity, "forbidden", "a learner's Hello needs the run token (security is off): the "
                         "learner reads it from security.run_token_file (default <run_dir>/broker/run_token, "
                         "written by the broker) or security.run_token; give it the broker's",
                         ref_kind=Kind.HELLO, reason="run_token")
            return
        try:
            peer, replaced = self.peers.hello(identity, hello, now_s, key=key)
        except RegistryFull as exc:
            self._reject(identity, "limit", str(exc), ref_kind=Kind.HELLO)
            return
        except ClientIdTaken as exc:
            self._reject(identity, "forbidden", str(exc), ref_kind=Kind.HELLO, reason="client_id_taken")
            return
        if replaced is not None:
            log.info("peer_restarted", peer=peer.name, old_session=replaced.session, session=peer.session)
            self._peer_gone(replaced, "restarted")
        if peer.role == "worker":
            self._worker_joined(peer, now_s)
        if peer.role == "learner":
            for other in self.peers.of_role("learner"):
                if other.identity != identity:
                    self._fence_learner(other, peer)
                    self._peer_gone(other, "replaced")
            if replaced is not None and replaced.identity != identity:  # the same client id on another route
                self._fence_learner(replaced, peer)
        restarted = peer.role == "learner" and hello.session != self.history.learner_session
        if restarted:
            self._learner_restarted(hello, now_s)  # its Welcome waits until the rollback is durable
        broker = self.config.broker
        self._send(identity, protocol.Welcome(
            broker_id=self.broker_id, latest_version=self.latest_version, group_size=self.group_size,
            groups_per_step=self.config.run.groups_per_step, max_staleness=self.max_staleness,
            heartbeat_interval_s=broker.heartbeat_interval_s,
            heartbeat_timeout_s=broker.heartbeat_interval_s * broker.heartbeat_misses,
            lease_timeout_s=broker.lease_timeout_s, max_message_bytes=broker.max_message_bytes,
            vocab_size=self.vocab_size), after_persist=restarted)
        newest = self.adapters.newest
        if peer.role == "worker" and newest is not None and hello.adapter_version < newest.version:
            self._send(identity, newest.notice())  # it fetches when it wants it (a reconnect storm moves no tensors)
        if replaced is not None or _peer is None:
            log.info("peer_joined", peer=peer.name, role=peer.role, session=peer.session, host=peer.host,
                     pid=peer.pid, adapter_version=peer.adapter_version)
        self._reconsider = True

    def _fence_learner(self, old: Peer, successor: Peer) -> None:
        """``old`` was replaced by the learner ``successor``: its identity is refused from now on, and it is told."""
        self.peers.fence(old, successor)
        log.warning("learner_replaced", old=old.name, old_session=old.session, new_session=successor.session,
                    new_host=successor.host, new_pid=successor.pid)
        self._reject(old.identity, "replaced", self._fenced_message(old.identity), ref_kind=Kind.HELLO)

    def _fenced_message(self, identity: bytes) -> str:
        return (f"this learner was replaced by another learner process, {self.peers.fenced_by(identity)}, that "
                "connected to the same broker; it must stop so that two learners never train one run (to run this "
                "one instead, stop the other and start this one again)")

    def _on_heartbeat(self, identity: bytes, peer: Peer, beat: protocol.Heartbeat, _env: Any, _frames: Any,
                      now_s: float) -> None:
        self.peers.heartbeat(peer, beat, now_s)
        if beat.lease_ids:
            self.stats.count("leases", "renewed", self.ledger.renew(identity, beat.lease_ids, now_s))
        self._send(identity, protocol.Heartbeat(latest_version=self.latest_version, state="idle"))
        self._reconsider = True

    def _on_bye(self, identity: bytes, peer: Peer, bye: protocol.Bye, _env: Any, _frames: Any, _now_s: float) -> None:
        self.peers.remove(identity)
        log.info("peer_left", peer=peer.name, reason=bye.reason)
        self._peer_gone(peer, "bye")

    def _peer_gone(self, peer: Peer, why: str) -> None:
        """Take back what a dead, departed or restarted client held."""
        identity = peer.identity
        self.ledger.end_leases_of(identity, Reason.RECLAIMED)
        if peer.role == "learner" and self.ledger.unserve_all():
            self._stale_checked_version = -1  # they may have aged while in training: check again
        self.lease_waiters.remove(identity)
        self.batch_waiters.remove(identity)
        self.stats.count("peers_gone", why)
        self._reconsider = True

    def _learner_restarted(self, hello: protocol.Hello, now_s: float) -> None:
        """A learner process that is not the one whose steps the history holds: it resumed from a checkpoint of
        version ``hello.adapter_version``. What it trained since is re-queued; what it published since is
        withdrawn from the adapter cache, the buffer and the workers (see :mod:`broker.history`)."""
        resumed = hello.adapter_version
        lost = self.history.rollback(resumed)
        for key in lost:
            if self.ledger.roll_back(key):
                self.num_trained_total -= 1
                self.num_trained_since_start -= 1
        self.stats.count("groups", "rolled_back", len(lost))
        withdrawn = resumed < self.latest_version and self.history.withdraw(resumed + 1, self.latest_version)
        if withdrawn:
            gone = self.adapters.withdraw(resumed + 1, self.latest_version)
            self.stats.count("adapters", "withdrawn", len(gone))
            self.base_version += self.latest_version - resumed  # the admission limit counts versions trained
            self._drop_withdrawn()
            self._answer_stale_lease_waiters(now_s)
        self.history.learner_session = hello.session
        self._reconsider = True
        log.info("learner_restarted", session=hello.session, resumed_version=resumed,
                 latest_version=self.latest_version, requeued=len(lost), withdrawn=self.history.withdrawn)

    # -- adapters --------------------------------------------------------------------------------------------

    def _on_adapter_update(self, identity: bytes, peer: Peer, update: protocol.AdapterUpdate,
                           envelope: framing.Envelope, frames: list[Any], now_s: float) -> None:
        restoring = (update.version == self.latest_version and self.adapters.get(update.version) is None
                     and not self.history.is_withdrawn(update.version))
        if restoring and self.latest_sha256 and update.sha256.lower() != self.latest_sha256.lower():
            self._reject(identity, "stale_version", f"AdapterUpdate version {update.version} was published before "
                         f"with other weights (sha256 {self.latest_sha256[:12]}...); a version number is never "
                         f"reused: publish version {self.latest_version + 1} or later",
                         ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(update.version))
            return
        if update.version <= self.latest_version and not restoring:
            self._reject(identity, "stale_version", f"AdapterUpdate version {update.version} does not advance the "
                         f"latest version {self.latest_version}; publish version {self.latest_version + 1} or later",
                         ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(update.version))
            return
        try:
            stored = self.adapters.add(update, envelope.specs, frames)
        except ProtocolError as exc:
            self._reject(identity, exc.code, str(exc), ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(update.version))
            return
        self.latest_version, self.latest_sha256 = update.version, update.sha256.lower()
        peer.adapter_version = update.version
        self._unsaved_adapter = (update.version, stored.message)
        self._send(identity, protocol.Ack(ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(update.version)),
                   after_persist=True)
        notice = stored.notice()
        for worker in self.peers.of_role("worker"):
            self._send(worker.identity, notice)
        self._answer_stale_lease_waiters(now_s)
        self._drop_stale()
        self.stats.count("adapters", "restored" if restoring else "published")
        log.info("adapter_published", version=update.version, step=update.step, num_bytes=stored.num_bytes,
                 num_tensors=stored.num_tensors, restored=restoring)
        self._reconsider = True

    def _on_adapter_fetch(self, identity: bytes, _peer: Peer, fetch: protocol.AdapterFetch, _env: Any,
                          _frames: Any, _now_s: float) -> None:
        stored = self.adapters.get(fetch.version)
        if stored is None:
            newest = self.adapters.newest
            have = f"kept: {[a['version'] for a in self.adapters.snapshot()]}" if newest else "none published yet"
            self._reject(identity, "stale_version", f"adapter version {fetch.version or 'newest'} is not kept "
                         f"({have}; latest version {self.latest_version})", ref_kind=Kind.ADAPTER_FETCH,
                         ref_id=str(fetch.version))
            return
        self.outbox.send(identity, Kind.ADAPTER_UPDATE, stored.message)

    # -- stats -----------------------------------------------------------------------------------------------

    def _on_stats_request(self, identity: bytes, _peer: Peer | None, _request: Any, _env: Any, _frames: Any,
                          now_s: float) -> None:
        """The snapshot, built and encoded once per state change: StatsRequests in between (a burst of them, from
        anyone: no Hello needed) share one encoded reply, so neither their CPU nor their unread replies grow with
        their number."""
        if self._stats_reply is None or self._stats_reply[0] != self._num_changes:
            frames = protocol.encode(protocol.Stats(snapshot=build_snapshot(self, now_s)))
            self._stats_reply = (self._num_changes, frames)
        self.outbox.send(identity, Kind.STATS, self._stats_reply[1])

    # -- timers and flushing ---------------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        """Deadlines: expired leases, dead peers, long-polls due, stats samples."""
        self._num_changes += 1
        for lease in self.ledger.expire(now_s):
            log.info("lease_expired", lease_id=lease.lease_id, group_id=group_id_of(lease.key),
                     worker=display_name(lease.worker))
        if now_s >= self._next_peer_check_s:
            self._next_peer_check_s = now_s + self.config.broker.heartbeat_interval_s * PEER_CHECK_FRACTION
            for peer in self.peers.dead(now_s):
                log.warning("peer_dead", peer=peer.name, silent_s=round(now_s - peer.last_seen_s, 2))
                self._peer_gone(peer, "dead")
        for waiters, answer in ((self.lease_waiters, self._answer_lease_waiter),
                                (self.batch_waiters, self._answer_batch_waiter)):
            for waiter in waiters.expired(now_s):
                answer(waiter, now_s, final=True)
        if now_s >= self._next_stats_s:
            self._next_stats_s = now_s + STATS_TICK_S
            self.stats.tick(now_s)
            self._set_gauges()

    def flush(self, now_s: float) -> list[Outgoing]:
        """Write the state if an ack needs it, serve parked long-polls if anything changed; what to send."""
        if self.outbox.needs_write:
            self._submit_write()
        self.outbox.release(self._durable_seq())
        while self._reconsider or self.ledger.num_changes != self._changes_seen:
            self._reconsider, self._changes_seen = False, self.ledger.num_changes
            if self.batch_waiters:
                self._drop_stale()
            while self.batch_waiters and self._answer_batch_waiter(self.batch_waiters.first(), now_s, final=False):
                self.batch_waiters.remove(self.batch_waiters.first().identity)
            self._serve_lease_waiters(now_s)
        return self.outbox.take()

    def next_wakeup_s(self, now_s: float) -> float:
        """When tick() next has something to do."""
        candidates = [self._next_stats_s, self._next_peer_check_s]
        lease_deadline = self.ledger.leases.next_deadline_s()
        if lease_deadline is not None:
            candidates.append(lease_deadline)
        for waiters in (self.lease_waiters, self.batch_waiters):
            deadline = waiters.next_deadline_s()
            if deadline is not None:
                candidates.append(deadline)
        return min(candidates)

    def drain(self, now_s: float) -> list[Outgoing]:
        """Shutting down: answer every parked long-poll (empty, reason draining) and write the state."""
        self.draining = True
        for waiter in self.lease_waiters:
            self._answer_lease_waiter(waiter, now_s, final=True)
        for waiter in self.batch_waiters:
            self._answer_batch_waiter(waiter, now_s, final=True)
        self.lease_waiters.clear()
        self.batch_waiters.clear()
        if self.writer is not None:
            self.writer.close()  # finishes a background write in progress
        self.persist()
        return self.outbox.drain()

    def _set_gauges(self) -> None:
        m = self.stats.metrics
        m.set("latest_version", self.latest_version)
        buffer = self.ledger.buffer
        m.set("buffer_groups", buffer.num_buffered)
        m.set("buffer_bytes", buffer.buffered_bytes)
        m.set("training_groups", buffer.num_training)
        m.set("training_bytes", buffer.training_bytes)
        m.set("leases_outstanding", self.ledger.num_leased)
        m.set("workers", self.peers.num_workers())
        m.set("prompts_queued", self.ledger.num_queued)
        m.set("lease_waiters", len(self.lease_waiters))
        m.set("batch_waiters", len(self.batch_waiters))
        m.set("quarantined_workers", self.quarantine.count(Status.QUARANTINED))
        m.set("probation_workers", self.quarantine.count(Status.PROBATION))
