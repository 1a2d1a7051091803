"""The broker's state machine: dispatch, role checks and one thin handler per message kind.

:class:`BrokerCore` owns no socket. :mod:`loraflow.broker.server` hands it every received multipart message
(``handle(identity, frames, now_s)``), calls ``tick`` for timers and ``flush`` for what to send. The state is
held by its parts, each the one owner of its piece::

    ledger    every prompt's and group's state, its lease and its frames     loraflow.broker.ledger
    outbox    every reply until zmq takes it (now, after durable, batched)   loraflow.broker.outbox
    leasing   admission, grants, parked LeaseRequests                        loraflow.broker.leasing
    groups    verdicts on RolloutGroups and what they do                     loraflow.broker.groups
    batching  Batches, BatchAcks, parked BatchRequests, quarantine hooks     loraflow.broker.batching
    relay     kept adapters, AdapterUpdates, fetches; notices (paced)        loraflow.broker.adapters
    progress  latest version and trained counts; history: what a restarted
              learner is reconciled with                                     loraflow.broker.history
    peers     the client registry, liveness, the heartbeat fast path         loraflow.broker.peers
    quarantine / stats and loop times / the state file                       their modules

Handlers validate first, then apply (:mod:`loraflow.broker.dispatch`: the order of the checks and why an exception
once a handler sets ``_applying`` ends the process); a RolloutGroup's checks are :func:`loraflow.broker.groups.judge`.

Semantics (the contract between roles, see the team plan), each told where it is kept:

- LeaseRequest / BatchRequest are long-polls: answered at once when something can be given, else parked and
  answered when state changes (a ledger transition, or a change of peers or versions: ``_reconsider``) or
  with an empty reply at its deadline (:mod:`loraflow.broker.leasing`, :mod:`loraflow.broker.batching`).
- RolloutGroup: only for a lease granted to the sender for that prompt; dedup by group id; refused groups'
  prompts re-queued at once (:mod:`loraflow.broker.groups`). BatchAck: the listed groups trained, the rest re-queued;
  its Ack only after the state write (:mod:`loraflow.broker.batching`, :mod:`loraflow.broker.outbox`).
- AdapterUpdate: the version advances (or restores) the latest; Ack after the state write, then notices to
  every worker (:mod:`loraflow.broker.adapters`).
- Hello: the run token for a learner (security off), one learner at a time, a restarted learner's rollback
  before its Welcome (:mod:`loraflow.broker.registration`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraflow.broker.adapters import AdapterCache, AdapterRelay, NoticePacer
from loraflow.broker.batching import BatchDesk
from loraflow.broker.dispatch import (
    KIND_NAMES,
    SENDERS,
    HalfApplied,
    claimed_role,
    num_bytes,
    peek_kind,
    refusal,
)
from loraflow.broker.groups import UNKNOWN, GroupDesk
from loraflow.broker.leasing import LeaseDesk
from loraflow.broker.outbox import Outbox, Outgoing
from loraflow.broker.peers import HeartbeatPath, Peer, PeerRegistry, display_name
from loraflow.broker.prompts import group_id_of
from loraflow.broker.quarantine import Quarantine
from loraflow.broker.registration import Registrar
from loraflow.broker.restore import StateKeeper, restore, state_of
from loraflow.broker.snapshot import StatsReply, set_gauges
from loraflow.broker.state import StateWriter
from loraflow.broker.stats import BrokerStats, LoopTimes
from loraflow.common import codec, framing, protocol
from loraflow.common.codes import ProtocolError
from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Kind
from loraflow.common.task_base import Task

log = get_logger("broker")

PEER_CHECK_FRACTION = 0.5  # check liveness every half heartbeat interval
STATS_TICK_S = 1.0


class BrokerCore:
    """Messages and the clock in, replies out; the state in the parts listed in the module docstring."""

    def __init__(self, config: Config, *, task: Task, vocab_size: int = 0, state_path: str | Path | None = None,
                 now_s: float | None = None, run_token: str | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        run, broker = config.run, config.broker
        self.config = config
        self.broker_id = uuid.uuid4().hex[:12]
        self.vocab_size = vocab_size
        self.capacity_groups = config.capacity_groups
        self.task_label = run.task if len(run.task) <= 128 else Path(run.task).name[-128:]
        self.state_path = Path(state_path) if state_path else None
        self.started_s, self.started_unix = now_s, time.time()

        self.stats = BrokerStats()
        self.loop_times = LoopTimes(self.stats)
        self.handled_kind = ""  # the kind of the message handle() last took (LoopTimes names slow steps by it)
        self.peers = PeerRegistry(heartbeat_interval_s=broker.heartbeat_interval_s, max_workers=broker.max_workers,
                                  heartbeat_misses=broker.heartbeat_misses, max_observers=broker.max_observers,
                                  max_heartbeats_per_second=broker.max_heartbeats_per_second)
        adapters = AdapterCache(broker.num_adapters_kept)
        self.quarantine = Quarantine(after=config.integrity.quarantine_after, window=config.integrity.quarantine_window)
        self.writer = (StateWriter(self.state_path, min_interval_s=broker.state_write_interval_ms / 1000)
                       if self.state_path else None)

        def to_unix(t: float) -> float:
            return self.started_unix + (t - self.started_s)

        restored = restore(config, task, state_path=self.state_path, stats=self.stats, broker_id=self.broker_id,
                           adapter_path=self.writer.adapter_path if self.writer else None, adapters=adapters,
                           quarantine=self.quarantine, to_unix=to_unix)
        self.ledger, self.progress, self.history = restored.ledger, restored.progress, restored.history
        self.lease_secret = restored.lease_secret
        self.ledger.source.on_reserve = lambda _end: self.persist()
        self.outbox = Outbox(self.stats)
        parts = dict(ledger=self.ledger, peers=self.peers, quarantine=self.quarantine, history=self.history,
                     progress=self.progress, outbox=self.outbox)
        self.leasing = LeaseDesk(config, task_label=self.task_label, **parts)
        self.groups = GroupDesk(config, ledger=self.ledger, quarantine=self.quarantine, history=self.history,
                                progress=self.progress, outbox=self.outbox, stats=self.stats, vocab_size=vocab_size)
        self.batching = BatchDesk(broker_id=self.broker_id, max_staleness=run.max_staleness, stats=self.stats,
                                  to_unix=to_unix, **parts)
        self.relay = AdapterRelay(adapters, history=self.history, progress=self.progress, peers=self.peers,
                                  outbox=self.outbox, stats=self.stats)
        # run_token: a learner's Hello must carry it (security off; common/run_token.py); None: not checked
        self.registrar = Registrar(config, broker_id=self.broker_id, vocab_size=vocab_size, run_token=run_token,
                                   relay=self.relay, leasing=self.leasing, batching=self.batching, stats=self.stats,
                                   **parts)
        self._handlers: dict[int, Callable[..., None]] = {
            kind: getattr(self, f"_on_{KIND_NAMES[kind]}") for kind in SENDERS if kind != Kind.HELLO}
        self._applying = False  # inside a handler's apply half (loraflow.broker.dispatch)
        self._beats = HeartbeatPath(broker.max_message_bytes)  # the common heartbeat's fast path
        self.notices = NoticePacer()  # AdapterNotices not yet handed out (loraflow.broker.adapters)
        self._reconsider = False  # a peer or version changed: a parked long-poll may be answerable (ledger: its own)
        self._changes_seen = 0
        self._num_changes = 0  # messages (other than StatsRequest) and ticks handled: what a Stats reply is of
        self._stats_reply = StatsReply()  # encoded once per _num_changes (loraflow.broker.snapshot)
        self._next_peer_check_s = now_s
        self._next_stats_s = now_s
        self.keeper = StateKeeper(self.writer, stats=self.stats, adapter=self.relay.take_unsaved,
                                  state=lambda: state_of(config, self.ledger, self.progress, self.history,
                                                         self.lease_secret, self.quarantine, to_unix))
        self.persist()

    @property
    def latest_version(self) -> int:
        return self.progress.latest_version

    def persist(self) -> None:
        """Write the state file now, in this thread (start, reserved block, shutdown)."""
        self.keeper.write_now()

    # -- replies ---------------------------------------------------------------------------------------------

    def _reject(self, identity: bytes, code: str, message: str, *, ref_kind: int = 0, ref_id: str = "",
                ref_version: int = 0, reason: str | None = None) -> None:
        if ref_kind == Kind.ROLLOUT_GROUP and (peer := self.peers.get(identity)) is not None:
            peer.num_groups_rejected += 1
        self.outbox.reject(identity, code, message, ref_kind=ref_kind, ref_id=ref_id, ref_version=ref_version,
                           reason=reason)

    def internal_error(self, identity: bytes, frames: list[Any]) -> None:
        """A handler's validation raised (a bug; nothing was applied): answer ``internal`` so the peer is not left
        waiting; counted in ``messages_in`` if it failed before it was (every message is)."""
        if not self.handled_kind:
            self.stats.count("messages_in", KIND_NAMES.get(peek_kind(frames), "undecodable"))
        self._reject(identity, "internal", "the broker failed to handle this message (see its log)",
                     ref_kind=peek_kind(frames))

    def has_work(self, now_s: float) -> bool:
        """Something to send, write or re-evaluate at ``now_s`` without waiting for a message (notices whose
        batch is not due yet are :meth:`next_wakeup_s`'s)."""
        return bool(self._reconsider or self.ledger.num_changes != self._changes_seen
                    or self.notices.due(now_s)
                    or self.outbox.has_ready(self.keeper.durable_seq))

    def send_failed(self, out: Outgoing, reason: str) -> None:
        """zmq refused ``out`` (server calls this); undo what the message promised (a ledger transition)."""
        self.stats.count("send_failed", reason)
        log.info("send_failed", peer=display_name(out.identity)[:64], kind=KIND_NAMES.get(out.kind), reason=reason)
        self.outbox.failed(out)

    # -- receiving -------------------------------------------------------------------------------------------

    def handle(self, identity: bytes, frames: list[Any], now_s: float, authenticated_role: str | None = None,
               authenticated_key: str | None = None) -> None:
        """One received message (the frames after the identity). ``authenticated_role`` is the role CURVE
        authentication bound to the sender's key (None without security): a client may act only in that role;
        ``authenticated_key`` names that key (``<role>:<name>``): a client id belongs to the key that registered
        it (:meth:`loraflow.broker.peers.PeerRegistry.hello`). Raises :class:`HalfApplied` for a bug in an apply half."""
        self.handled_kind = ""  # set where the message is counted in messages_in (internal_error reads it)
        peer = self.peers.get(identity)
        if peer is not None and (beat := self._beats.decode(frames, peer, authenticated_role)) is not None:
            self._num_changes += 1  # the common heartbeat, accepted as the path below would (HeartbeatPath)
            self.handled_kind = "heartbeat"
            self.stats.bytes_in += len(frames[0]) + len(frames[1])
            self.stats.count("messages_in", "heartbeat")
            self.peers.heard(identity, now_s)
            try:
                self._on_heartbeat(identity, peer, beat, None, frames, now_s)
            except Exception as exc:
                raise HalfApplied(f"heartbeat from {display_name(identity)[:64]}: {exc!r}") from exc
            finally:
                self._applying = False
            return
        try:
            envelope = codec.decode_envelope(frames, self.config.broker.max_message_bytes)
        except ProtocolError as exc:
            self.stats.bytes_in += num_bytes(frames)
            self.stats.count("messages_in", "undecodable")
            self.handled_kind = "undecodable"
            self._num_changes += 1
            self._reject(identity, exc.code, str(exc), ref_kind=peek_kind(frames))
            return
        kind = envelope.kind
        if kind != Kind.STATS_REQUEST:
            self._num_changes += 1
        self.stats.bytes_in += envelope.num_bytes
        self.stats.count("messages_in", KIND_NAMES[kind])
        self.handled_kind = KIND_NAMES[kind]
        if envelope.unknown_fields:  # a newer client's fields: ignored (loraflow.common.protocol's compatibility rule)
            self.stats.count("unknown_fields", KIND_NAMES[kind])
        if self.peers.fenced_by(identity) is not None:
            self._reject(identity, "replaced", self.registrar.fenced_message(identity), ref_kind=kind)
            return
        peer = self.peers.heard(identity, now_s)
        refused = refusal(kind, claimed_role(envelope), peer.role if peer else None, authenticated_role)
        if refused is not None:
            self._reject(identity, *refused, ref_kind=kind)
            return
        try:
            record, malformed = codec.decode_record(envelope), None
        except ProtocolError as exc:
            record, malformed = None, exc
        try:
            if malformed is not None:
                self._on_malformed(identity, kind, envelope.header, malformed)
            elif kind == Kind.HELLO:
                self._on_hello(identity, peer, record, now_s, key=authenticated_key)
            else:
                self._handlers[kind](identity, peer, record, envelope, frames, now_s)
        except Exception as exc:
            if self._applying:
                raise HalfApplied(f"{KIND_NAMES[kind]} from {display_name(identity)[:64]}: {exc!r}") from exc
            raise
        finally:
            self._applying = False

    def _on_malformed(self, identity: bytes, kind: int, header: dict[str, Any], exc: ProtocolError) -> None:
        """A record that failed its decode: Error; a RolloutGroup's lease, if the sender holds it, goes back at once
        (the worker drops a refused group: waiting for lease_timeout_s would only idle the prompt)."""
        ref_id = header.get("group_id", "")
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        if kind == Kind.ROLLOUT_GROUP:
            self.groups.malformed(identity, header)
        self._reject(identity, exc.code, str(exc), ref_kind=kind, ref_id=ref_id if isinstance(ref_id, str) else "")

    # -- registration and liveness ---------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, old_peer: Peer | None, hello: protocol.Hello, now_s: float,
                  key: str | None = None) -> None:
        refused = self.registrar.refusal(hello)
        if refused is not None:
            code, message, reason = refused
            self._reject(identity, code, message, ref_kind=Kind.HELLO, reason=reason)
            return
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        self.registrar.hello(identity, old_peer, hello, now_s, key)
        self._reconsider = True

    def _on_heartbeat(self, identity: bytes, peer: Peer, beat: protocol.Heartbeat, _env: Any, _frames: Any,
                      now_s: float) -> None:
        """The pong is encoded once per version and sent when :meth:`Peer.pong_due` (often enough for the client's
        silence timeout, not for every beat); parked long-polls are reconsidered only when the beat changes the
        worker's adapter version (nothing else a beat reports changes what a lease request can be granted)."""
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        if self.peers.heartbeat(peer, beat, now_s):
            self._reconsider = True
        if beat.lease_ids:
            self.stats.count("leases", "renewed", self.ledger.renew(identity, beat.lease_ids, now_s))
        if peer.pong_due(now_s, self.peers.interval_s):
            frames, size = self._beats.pong(self.latest_version, self.peers.interval_s)
            self.outbox.send(identity, Kind.HEARTBEAT, frames, num_bytes=size)

    def _on_bye(self, identity: bytes, peer: Peer, bye: protocol.Bye, _env: Any, _frames: Any, _now_s: float) -> None:
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        self.registrar.bye(identity, peer, bye)
        self._reconsider = True

    # -- work ------------------------------------------------------------------------------------------------

    def _on_lease_request(self, identity: bytes, peer: Peer, request: protocol.LeaseRequest, _env: Any, _frames: Any,
                          now_s: float) -> None:
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        self.leasing.request(identity, peer, request, now_s)

    def _on_lease_return(self, identity: bytes, _peer: Peer, returned: protocol.LeaseReturn, _env: Any, _frames: Any,
                         _now_s: float) -> None:
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        unknown = self.leasing.give_back(identity, returned.lease_ids)
        if unknown:
            self._reject(identity, "unknown_lease", f"lease(s) {unknown[:8]} are not held by you (expired, "
                         "reclaimed or never granted)", ref_kind=Kind.LEASE_RETURN, ref_id=unknown[0])

    def _on_rollout_group(self, identity: bytes, peer: Peer, group: protocol.RolloutGroup,
                          envelope: framing.Envelope, _frames: Any, now_s: float) -> None:
        verdict = self.groups.judge(identity, peer, group, envelope)
        if verdict.outcome == UNKNOWN:
            self.groups.reject(identity, peer, verdict, group.group_id)
            return
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        self.groups.apply(identity, peer, group, envelope, verdict, now_s)

    def _on_batch_request(self, identity: bytes, _peer: Peer, request: protocol.BatchRequest, _env: Any, _frames: Any,
                          now_s: float) -> None:
        if request.num_groups > self.ledger.buffer.max_groups:
            self._reject(identity, "limit", f"BatchRequest for {request.num_groups} groups can never be filled: the "
                         f"broker holds at most {self.ledger.buffer.max_groups} (broker.capacity_groups)",
                         ref_kind=Kind.BATCH_REQUEST)
            return
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        self.batching.request(identity, request, now_s)

    def _on_batch_ack(self, identity: bytes, _peer: Peer, ack: protocol.BatchAck, _env: Any, _frames: Any,
                      now_s: float) -> None:
        if not self.batching.knows(ack):
            self._reject(identity, "unknown_batch", f"batch {ack.batch_id!r} is unknown to this broker and the ack "
                         "lists no group_ids", ref_kind=Kind.BATCH_ACK, ref_id=ack.batch_id)
            return
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        self.batching.settle(ack, now_s)
        self.outbox.send_record(identity, protocol.BatchSettled(ref_id=ack.batch_id), after_durable=True)
        self._reconsider = True  # a quarantine may have begun

    # -- adapters and stats --------------------------------------------------------------------------------

    def _on_adapter_update(self, identity: bytes, peer: Peer, update: protocol.AdapterUpdate,
                           envelope: framing.Envelope, frames: list[Any], now_s: float) -> None:
        refused = self.relay.refusal(update, frames)
        if refused is not None:
            self._reject(identity, *refused, ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(update.version),
                         ref_version=update.version)
            return
        self._applying = True  # validated: the apply half (loraflow.broker.dispatch)
        self.relay.publish(identity, peer, update, envelope, frames)
        self.leasing.answer_stale(now_s)
        self.batching.drop_stale()
        self._reconsider = True

    def _on_adapter_fetch(self, identity: bytes, _peer: Peer, fetch: protocol.AdapterFetch, _env: Any,
                          _frames: Any, _now_s: float) -> None:
        missing = self.relay.fetch(identity, fetch)
        if missing is not None:
            self._reject(identity, "stale_version", missing, ref_kind=Kind.ADAPTER_FETCH, ref_id=str(fetch.version),
                         ref_version=fetch.version)

    def _on_stats_request(self, identity: bytes, _peer: Peer | None, _request: Any, _env: Any, _frames: Any,
                          now_s: float) -> None:
        self.outbox.send(identity, Kind.STATS, self._stats_reply.frames(self, self._num_changes, now_s))

    # -- timers and flushing ---------------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        """Deadlines: expired leases, dead peers, long-polls due, stats samples."""
        self._num_changes += 1
        for lease in self.ledger.expire(now_s):
            log.info("lease_expired", lease_id=lease.lease_id, group_id=group_id_of(lease.key),
                     worker=display_name(lease.worker))
        if now_s >= self._next_peer_check_s:
            self._next_peer_check_s = now_s + self.config.broker.heartbeat_interval_s * PEER_CHECK_FRACTION
            if self.registrar.dead(now_s):
                self._reconsider = True
        if self.leasing.waiters:
            self.leasing.expire_waiters(now_s)
        if self.batching.waiters:
            self.batching.expire_waiters(now_s)
        if now_s >= self._next_stats_s:
            self._next_stats_s = now_s + STATS_TICK_S
            self.stats.tick(now_s)
            self.loop_times.roll(now_s)
            set_gauges(self)

    def flush(self, now_s: float) -> list[Outgoing]:
        """Write the state if a reply needs it, serve parked long-polls if anything changed; what to send."""
        if self.outbox.needs_write:
            self.outbox.written(self.keeper.submit())
        self.outbox.release(self.keeper.durable_seq)
        while self._reconsider or self.ledger.num_changes != self._changes_seen:
            self._reconsider, self._changes_seen = False, self.ledger.num_changes
            if self.batching.waiters:
                self.batching.serve_waiters()
            if self.leasing.waiters:
                self.leasing.serve_waiters(now_s)
        return self.notices.spread(self.outbox.take(), now_s)

    def next_wakeup_s(self, _now_s: float) -> float:
        """When tick() next has something to do."""
        deadlines = (self.ledger.leases.next_deadline_s(), self.leasing.waiters.next_deadline_s(),
                     self.batching.waiters.next_deadline_s(), self.notices.next_due_s())
        return min(self._next_stats_s, self._next_peer_check_s, *(d for d in deadlines if d is not None))

    def stop_leasing(self, now_s: float) -> None:
        """The run was cancelled: no lease from now on (parked requests answered ``draining``); what is buffered
        can still be trained and acknowledged."""
        self.progress.draining = True
        self.leasing.drain(now_s)

    def drain(self, now_s: float) -> list[Outgoing]:
        """Shutting down: answer every parked long-poll (empty, reason draining) and write the state."""
        self.progress.draining = True
        self.leasing.drain(now_s)
        self.batching.drain()
        self.keeper.close()
        return [*self.notices.take_all(), *self.outbox.drain()]
