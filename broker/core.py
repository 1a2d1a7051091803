"""The broker's state machine: what each message does to the prompts, leases, buffer, adapters and peers.

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
  *waiter* and answered when state changes (``_dirty``) or with an empty reply at its deadline.
- RolloutGroup: dedup by group id (buffered/training/trained -> Ack duplicate); a group for a prompt whose
  lease expired is still accepted (and any newer lease on it cancelled); invalid, too stale or over the byte
  bound -> Error and the prompt is re-queued.
- BatchAck: the listed groups are trained (none listed = the whole batch); a batch's unlisted groups are
  re-queued; an unknown batch id (a restarted broker) marks the listed ids trained. The Ack is sent only
  after the state file is written (one write for all acks handled in one loop pass: group commit).
- AdapterUpdate: version must exceed the latest (or equal it when this broker lost the frames in a restart);
  Ack after the state write, then an AdapterNotice to every worker. Workers saying Hello with an older
  version get the newest AdapterUpdate right after their Welcome.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from broker import admission
from broker.adapters import AdapterCache
from broker.buffer import RolloutBuffer, StoredGroup
from broker.leases import Lease, LeaseTable
from broker.peers import Peer, PeerRegistry, RegistryFull
from broker.prompts import PromptKey, PromptSource, group_id_of, parse_group_id
from broker.snapshot import build_snapshot
from broker.state import BrokerState, StateWriter, check_matches, load_adapter, load_state, make_state
from broker.stats import BrokerStats
from common import framing, protocol, versions
from common.config import Config
from common.logging import get_logger
from common.protocol import Kind, ProtocolError
from common.tasks import Task

log = get_logger("broker")

KIND_NAMES = {int(k): k.name.lower() for k in Kind}
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


@dataclass(slots=True)
class Outgoing:
    identity: bytes
    frames: list[Any]
    kind: int
    on_fail: Callable[[], None] | None = None


@dataclass(slots=True, kw_only=True)
class Waiter:
    identity: bytes
    request: Any  # LeaseRequest or BatchRequest
    deadline_s: float


def _peek_kind(frames: list[Any]) -> int:
    try:
        magic, _, kind = framing.PREAMBLE.unpack(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
    except Exception:  # anything that is not a preamble
        return 0
    return kind if magic == framing.MAGIC and 0 < kind < 1 << 16 else 0


def _nbytes(frames: list[Any]) -> int:
    return sum(len(f) for f in frames)


class BrokerCore:
    """Prompts, leases, buffer, adapters, peers and stats, driven by messages and the clock."""

    def __init__(self, config: Config, *, task: Task, vocab_size: int = 0, state_path: str | Path | None = None,
                 now_s: float | None = None) -> None:
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
        self.started_s, self.started_unix = now_s, time.time()

        self.stats = BrokerStats()
        self.peers = PeerRegistry(heartbeat_interval_s=broker.heartbeat_interval_s,
                                  heartbeat_misses=broker.heartbeat_misses, max_workers=broker.max_workers)
        self.leases = LeaseTable(timeout_s=broker.lease_timeout_s, max_per_worker=broker.max_leases_per_worker,
                                 id_prefix=f"{self.broker_id[:6]}.")
        self.buffer = RolloutBuffer(max_groups=self.capacity_groups, max_bytes=broker.max_buffer_bytes)
        self.adapters = AdapterCache(broker.num_adapters_kept)
        self.latest_version = 0
        self.num_trained_total = 0  # over the run's lifetime (persisted)
        self.num_trained_since_start = 0  # for the admission limit, counted from base_version
        self.mean_group_bytes = 0.0
        self.draining = False
        self.learner_progress: dict[str, int] = {}

        self.writer = StateWriter(self.state_path) if self.state_path else None
        self._unsaved_adapter: tuple[int, list[Any]] | None = None
        self.prompts = self._restore(task)
        self.base_version = self.latest_version
        self.prompts.on_reserve = lambda _end: self.persist()

        self._handlers = {kind: getattr(self, f"_on_{KIND_NAMES[kind]}") for kind in SENDERS}
        self.lease_waiters: deque[Waiter] = deque()
        self.batch_waiters: deque[Waiter] = deque()
        self.outbox: list[Outgoing] = []
        self._unsubmitted: list[Outgoing] = []  # replies that need the next state write
        self._awaiting_write: deque[tuple[int, list[Outgoing]]] = deque()  # (write seq, replies)
        self._persist_due = False
        self._dirty = False
        self._batch_seq = 0
        self._stale_checked_version = -1
        self._next_peer_check_s = now_s
        self._next_stats_s = now_s
        self.persist()

    # -- persistence -----------------------------------------------------------------------------------------

    def _restore(self, task: Task) -> PromptSource:
        """The prompt source, latest version, trained count and newest adapter as the last process left them."""
        broker, run = self.config.broker, self.config.run
        block = max(RESERVE_BLOCK, 4 * self.capacity_groups)
        fresh = PromptSource(task, prompt_limit=broker.prompt_limit, num_epochs=broker.num_epochs,
                             reserve_block=block)
        if self.writer is not None:
            self._restore_adapter(self.writer.adapter_path)
        persisted = load_state(self.state_path) if self.state_path else None
        if persisted is None:
            return fresh
        check_matches(persisted, task=run.task, seed=run.seed, epoch_size=fresh.epoch_size, path=str(self.state_path))
        self.latest_version = max(self.latest_version, persisted.latest_version)
        self.num_trained_total = persisted.num_trained_groups
        requeued = sorted(set(persisted.pending_keys())
                          | set(fresh.keys_between(persisted.cursor_key, persisted.reserved_key)))
        requeued = [k for k in requeued if not broker.num_epochs or k[0] < broker.num_epochs]
        log.info("state_restored", path=str(self.state_path), cursor=list(persisted.reserved_key),
                 requeued=len(requeued), latest_version=self.latest_version)
        return PromptSource(task, prompt_limit=broker.prompt_limit, num_epochs=broker.num_epochs, reserve_block=block,
                            cursor=persisted.reserved_key, requeued=requeued)

    def _restore_adapter(self, path: Path) -> None:
        """Serve the adapter saved by the previous process (it may be one version ahead of the state file)."""
        frames = load_adapter(path)
        if frames is None:
            return
        update, envelope = protocol.decode(frames)
        if not isinstance(update, protocol.AdapterUpdate):
            raise ValueError(f"{path} holds a {type(update).__name__}, not an AdapterUpdate; move it away")
        self.adapters.add(update, envelope.specs, frames)
        self.latest_version = max(self.latest_version, update.version)
        log.info("adapter_restored", version=update.version, path=str(path))

    def _state(self) -> BrokerState:
        return make_state(
            task=self.config.run.task, seed=self.config.run.seed, epoch_size=self.prompts.epoch_size,
            cursor=self.prompts.cursor, reserved_until=self.prompts.reserved_until,
            pending=self.prompts.pending_keys(), latest_version=self.latest_version,
            num_trained_groups=self.num_trained_total)

    def persist(self) -> None:
        """Write the state file now, in this thread (start, reserved block, shutdown)."""
        if self.writer is not None:
            adapter, self._unsaved_adapter = self._unsaved_adapter, None
            self.writer.write(self._state(), adapter)
            self.stats.count("state_writes", "sync")

    def _submit_write(self) -> None:
        """Hand the current state to the background writer; replies waiting for it go out once it is durable."""
        self._persist_due = False
        replies, self._unsubmitted = self._unsubmitted, []
        if self.writer is None:
            self.outbox.extend(replies)
            return
        adapter, self._unsaved_adapter = self._unsaved_adapter, None
        seq = self.writer.submit(self._state(), adapter)
        self.stats.count("state_writes", "background")
        self._awaiting_write.append((seq, replies))

    def _release_durable(self) -> None:
        """Move replies whose state write is on disk to the outbox."""
        durable = self.writer.durable_seq if self.writer is not None else 0
        while self._awaiting_write and self._awaiting_write[0][0] <= durable:
            self.outbox.extend(self._awaiting_write.popleft()[1])

    # -- sending ---------------------------------------------------------------------------------------------

    def _send_frames(self, identity: bytes, kind: int, frames: list[Any], on_fail: Callable[[], None] | None = None,
                     after_persist: bool = False, num_bytes: int | None = None) -> None:
        out = Outgoing(identity, frames, kind, on_fail)
        (self._unsubmitted if after_persist else self.outbox).append(out)
        self.stats.count("messages_out", KIND_NAMES[kind])
        self.stats.bytes_out += _nbytes(frames) if num_bytes is None else num_bytes

    def _send(self, identity: bytes, record: Any, on_fail: Callable[[], None] | None = None,
              after_persist: bool = False) -> None:
        self._send_frames(identity, int(record.KIND), protocol.encode(record), on_fail, after_persist)

    def _reject(self, identity: bytes, code: str, message: str, *, ref_kind: int = 0, ref_id: str = "",
                reason: str | None = None) -> None:
        self.stats.count("rejected", reason or code)
        peer = self.peers.get(identity)
        if peer is not None and ref_kind == Kind.ROLLOUT_GROUP:
            peer.num_groups_rejected += 1
        log.debug("rejected", peer=identity.decode(errors="replace")[:64], code=code, error=message[:300])
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
        durable = self.writer.durable_seq if self.writer is not None else 0
        return bool(self.outbox or self._dirty or self._persist_due
                    or (self._awaiting_write and self._awaiting_write[0][0] <= durable))

    def send_failed(self, out: Outgoing, reason: str) -> None:
        """zmq refused ``out`` (server calls this); undo what the message promised."""
        self.stats.count("send_failed", reason)
        log.info("send_failed", peer=out.identity.decode(errors="replace")[:64], kind=KIND_NAMES.get(out.kind),
                 reason=reason)
        if out.on_fail is not None:
            out.on_fail()
            self._dirty = True

    @property
    def mean_group_footprint(self) -> float:
        """Mean bytes a group is charged in the buffer (0 before the first group)."""
        return self.mean_group_bytes + self.buffer.group_overhead_bytes if self.mean_group_bytes else 0.0

    # -- receiving -------------------------------------------------------------------------------------------

    def handle(self, identity: bytes, frames: list[Any], now_s: float, authenticated_role: str | None = None) -> None:
        """One received message (the frames after the identity). ``authenticated_role`` is the role CURVE
        authentication bound to the sender's key (None without security): a client may act only in that role."""
        try:
            envelope = protocol.decode_envelope(frames, self.config.broker.max_message_bytes)
        except ProtocolError as exc:
            self.stats.bytes_in += _nbytes(frames)
            self.stats.count("messages_in", "undecodable")
            self._reject(identity, exc.code, str(exc), ref_kind=_peek_kind(frames))
            return
        kind = envelope.kind
        self.stats.bytes_in += envelope.num_bytes
        self.stats.count("messages_in", KIND_NAMES[kind])
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
            ref_id = envelope.header.get("group_id", "")
            self._reject(identity, exc.code, str(exc), ref_kind=kind, ref_id=ref_id if isinstance(ref_id, str) else "")
            return
        self._handlers[kind](identity, peer, record, envelope, frames, now_s)

    # -- registration and liveness ---------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, _peer: Peer | None, hello: protocol.Hello, _env: Any, _frames: Any,
                  now_s: float) -> None:
        try:
            peer, replaced = self.peers.hello(identity, hello, now_s)
        except RegistryFull as exc:
            self._reject(identity, "limit", str(exc), ref_kind=Kind.HELLO)
            return
        if replaced is not None:
            log.info("peer_restarted", peer=peer.name, old_session=replaced.session, session=peer.session)
            self._peer_gone(replaced, "restarted")
        if peer.role == "learner":
            for other in self.peers.of_role("learner"):
                if other.identity != identity:
                    log.warning("learner_replaced", old=other.name, new=peer.name)
                    self.peers.remove(other.identity)
                    self._peer_gone(other, "replaced")
        broker = self.config.broker
        self._send(identity, protocol.Welcome(
            broker_id=self.broker_id, latest_version=self.latest_version, group_size=self.group_size,
            groups_per_step=self.config.run.groups_per_step, max_staleness=self.max_staleness,
            heartbeat_interval_s=broker.heartbeat_interval_s,
            heartbeat_timeout_s=broker.heartbeat_interval_s * broker.heartbeat_misses,
            lease_timeout_s=broker.lease_timeout_s, max_message_bytes=broker.max_message_bytes,
            vocab_size=self.vocab_size))
        newest = self.adapters.newest
        if peer.role == "worker" and newest is not None and hello.adapter_version < newest.version:
            self._send_frames(identity, Kind.ADAPTER_UPDATE, newest.message)
        if replaced is not None or _peer is None:
            log.info("peer_joined", peer=peer.name, role=peer.role, session=peer.session, host=peer.host,
                     pid=peer.pid, adapter_version=peer.adapter_version)
        self._dirty = True

    def _on_heartbeat(self, identity: bytes, peer: Peer, beat: protocol.Heartbeat, _env: Any, _frames: Any,
                      now_s: float) -> None:
        self.peers.heartbeat(peer, beat, now_s)
        self._send(identity, protocol.Heartbeat(latest_version=self.latest_version, state="idle"))
        self._dirty = True

    def _on_bye(self, identity: bytes, peer: Peer, bye: protocol.Bye, _env: Any, _frames: Any, _now_s: float) -> None:
        self.peers.remove(identity)
        log.info("peer_left", peer=peer.name, reason=bye.reason)
        self._peer_gone(peer, "bye")

    def _peer_gone(self, peer: Peer, why: str) -> None:
        """Take back what a dead, departed or restarted client held."""
        identity = peer.identity
        for lease in self.leases.reclaim(identity):
            self.prompts.requeue(lease.key)
            self.stats.count("leases", "reclaimed")
        if peer.role == "learner":
            for batch_id in self.buffer.batch_ids():
                for group in self.buffer.unserve(batch_id):
                    self.prompts.set_state(group.key, "buffered")
                    self.stats.count("groups", "restored")
        for waiters in (self.lease_waiters, self.batch_waiters):
            for waiter in [w for w in waiters if w.identity == identity]:
                waiters.remove(waiter)
        self.stats.count("peers_gone", why)
        self._dirty = True

    # -- leases ----------------------------------------------------------------------------------------------

    def _admission(self, identity: bytes, peer: Peer, requested: int) -> admission.Decision:
        return admission.decide(admission.AdmissionInputs(
            requested=requested, worker_version=peer.adapter_version, latest_version=self.latest_version,
            max_staleness=self.max_staleness, groups_per_step=self.groups_per_version,
            capacity_groups=self.capacity_groups, num_leased=len(self.leases), num_stored=self.buffer.num_groups,
            num_trained_groups=self.num_trained_since_start, base_version=self.base_version,
            worker_leases=self.leases.count(identity),
            max_leases_per_worker=self.config.broker.max_leases_per_worker, stored_bytes=self.buffer.memory_bytes,
            mean_group_bytes=self.mean_group_footprint, max_buffer_bytes=self.buffer.max_bytes,
            prompts_available=self.prompts.available(requested), draining=self.draining))

    def _on_lease_request(self, identity: bytes, peer: Peer, request: protocol.LeaseRequest, _env: Any,
                          _frames: Any, now_s: float) -> None:
        peer.adapter_version = request.adapter_version
        if not self._try_grant(identity, peer, request, now_s, final=request.wait_ms == 0):
            self.lease_waiters.append(Waiter(identity=identity, request=request,
                                             deadline_s=now_s + request.wait_ms / 1000))

    def _try_grant(self, identity: bytes, peer: Peer, request: protocol.LeaseRequest, now_s: float,
                   final: bool) -> bool:
        """Grant what admission allows; returns False (nothing sent) when nothing is granted and not final."""
        decision = self._admission(identity, peer, request.max_leases)
        if decision.num_leases == 0 and not final and decision.reason not in ("stale_adapter", "draining"):
            return False
        granted: list[Lease] = []
        for _ in range(decision.num_leases):
            key = self.prompts.next()
            if key is None:
                break
            granted.append(self.leases.grant(key, identity, now_s))
        reason = decision.reason if len(granted) == decision.num_leases else "no_prompts"
        if not granted and not final and reason not in ("stale_adapter", "draining"):
            return False
        leases = []
        for lease in granted:
            item = self.prompts.item(lease.key)
            leases.append(protocol.PromptLease(
                lease_id=lease.lease_id, group_id=group_id_of(lease.key), prompt_index=lease.key[1],
                epoch=lease.key[0], task=self.task_label, prompt=item.prompt, answer=item.answer, meta=item.meta,
                group_size=self.group_size, deadline_s=self.leases.timeout_s))
        peer.num_leases_granted += len(granted)
        self.stats.count("leases", "granted", len(granted))
        self._send(identity, protocol.LeaseGrant(leases=leases, reason=reason, latest_version=self.latest_version),
                   on_fail=lambda: self._return_leases(granted, "undeliverable"))
        return True

    def _return_leases(self, leases: list[Lease], event: str) -> None:
        for lease in leases:
            if self.leases.get(lease.lease_id) is lease:
                self.leases.pop(lease.lease_id)
                self.prompts.requeue(lease.key)
                self.stats.count("leases", event)

    def _on_lease_return(self, identity: bytes, _peer: Peer, returned: protocol.LeaseReturn, _env: Any,
                         _frames: Any, _now_s: float) -> None:
        unknown = []
        for lease_id in returned.lease_ids:
            lease = self.leases.get(lease_id)
            if lease is None or lease.worker != identity:
                unknown.append(lease_id)
            else:
                self._return_leases([lease], "returned")
        self._dirty = True
        if unknown:
            self._reject(identity, "unknown_lease", f"lease(s) {unknown[:8]} are not held by you (expired, "
                         "reclaimed or never granted)", ref_kind=Kind.LEASE_RETURN, ref_id=unknown[0])

    # -- rollout groups --------------------------------------------------------------------------------------

    def _on_rollout_group(self, identity: bytes, peer: Peer, group: protocol.RolloutGroup,
                          envelope: framing.Envelope, _frames: Any, now_s: float) -> None:
        key = parse_group_id(group.group_id)
        state = self.prompts.state(key) if key is not None else "new"
        if key is None or state == "new":
            self._reject(identity, "unknown_lease", f"group {group.group_id!r} (lease {group.lease_id!r}) was never "
                         "leased by this broker", ref_kind=Kind.ROLLOUT_GROUP, ref_id=group.group_id)
            return
        if state in ("buffered", "training", "trained"):
            self.stats.count("groups", "duplicate")
            self._send(identity, protocol.Ack(ref_kind=Kind.ROLLOUT_GROUP, ref_id=group.group_id, status="duplicate"))
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
        if not self.buffer.fits(envelope.num_bytes):
            self.stats.count("dropped", "buffer_full")
            self._refuse_group(identity, key, group, "limit",
                               f"RolloutGroup {group.group_id}: {envelope.num_bytes} bytes do not fit the buffer "
                               f"({self.buffer.memory_bytes} of broker.max_buffer_bytes={self.buffer.max_bytes} "
                               "used, counting per-group overhead); "
                               "the prompt was re-queued", reason="buffer_full")
            return
        lease = self.leases.cancel_key(key)
        if lease is not None:
            self.stats.count("leases", "submitted" if lease.lease_id == group.lease_id else "cancelled")
        self.prompts.set_state(key, "buffered")
        num_tokens = sum(group.completion_lens)
        self.buffer.add(StoredGroup(group_id=group.group_id, key=key, header=envelope.header,
                                    wire_specs=[s.to_wire() for s in envelope.specs],
                                    frames=envelope.frames, num_bytes=envelope.num_bytes,
                                    min_version=group.min_version, num_tokens=num_tokens, worker=peer.client_id,
                                    received_s=now_s))
        weight = 0.1 if self.mean_group_bytes else 1.0
        self.mean_group_bytes += weight * (envelope.num_bytes - self.mean_group_bytes)
        peer.num_groups_accepted += 1
        self.stats.count("groups", "accepted")
        self.stats.tokens_accepted += num_tokens
        self._send(identity, protocol.Ack(ref_kind=Kind.ROLLOUT_GROUP, ref_id=group.group_id))
        self._dirty = True

    def _refuse_group(self, identity: bytes, key: PromptKey, group: protocol.RolloutGroup, code: str, message: str,
                      reason: str | None = None) -> None:
        """Error for a group that will not be buffered; its prompt goes back to the queue."""
        lease = self.leases.get(group.lease_id)
        if lease is not None and lease.key == key:
            self._return_leases([lease], "refused")
        # otherwise the prompt is queued already, or leased again to another worker (theirs to deliver)
        self._reject(identity, code, message, ref_kind=Kind.ROLLOUT_GROUP, ref_id=group.group_id, reason=reason)
        self._dirty = True

    # -- adapters --------------------------------------------------------------------------------------------

    def _on_adapter_update(self, identity: bytes, peer: Peer, update: protocol.AdapterUpdate,
                           envelope: framing.Envelope, frames: list[Any], _now_s: float) -> None:
        restoring = update.version == self.latest_version and self.adapters.get(update.version) is None
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
        self.latest_version = update.version
        peer.adapter_version = update.version
        self._unsaved_adapter = (update.version, stored.message)
        self._persist_due = True
        self._send(identity, protocol.Ack(ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(update.version)),
                   after_persist=True)
        notice = stored.notice()
        for worker in self.peers.of_role("worker"):
            self._send(worker.identity, notice)
        self._drop_stale()
        self.stats.count("adapters", "restored" if restoring else "published")
        log.info("adapter_published", version=update.version, step=update.step, num_bytes=stored.num_bytes,
                 num_tensors=stored.num_tensors, restored=restoring)
        self._dirty = True

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
        self._send_frames(identity, Kind.ADAPTER_UPDATE, stored.message)

    # -- batches ---------------------------------------------------------------------------------------------

    def _drop_stale(self) -> None:
        if self._stale_checked_version == self.latest_version:
            return
        self._stale_checked_version = self.latest_version
        for group in self.buffer.drop_stale(self.latest_version, self.max_staleness):
            self.prompts.requeue(group.key)
            self.stats.count("dropped", "stale")
            self._dirty = True

    def _on_batch_request(self, identity: bytes, peer: Peer, request: protocol.BatchRequest, _env: Any,
                          _frames: Any, now_s: float) -> None:
        self.learner_progress["learner_version"] = request.learner_version
        if request.num_groups > self.buffer.max_groups:
            self._reject(identity, "limit", f"BatchRequest for {request.num_groups} groups can never be filled: the "
                         f"broker holds at most {self.buffer.max_groups} (broker.capacity_groups)",
                         ref_kind=Kind.BATCH_REQUEST)
            return
        self._drop_stale()
        if not self._try_serve(identity, request, final=request.wait_ms == 0):
            self.batch_waiters.append(Waiter(identity=identity, request=request,
                                             deadline_s=now_s + request.wait_ms / 1000))

    def _try_serve(self, identity: bytes, request: protocol.BatchRequest, final: bool) -> bool:
        batch_id = f"{self.broker_id}.{self._batch_seq + 1}"
        groups = self.buffer.serve(request.num_groups, batch_id)
        if groups is None:
            if final:
                self._send(identity, protocol.Batch(latest_version=self.latest_version))
            return final
        self._batch_seq += 1
        entries, specs, frames = [], [], []
        for group in groups:
            self.prompts.set_state(group.key, "training")
            self.stats.count("served_staleness", versions.staleness(self.latest_version, group.min_version))
            entries.append({"group": group.header, "first_tensor": len(specs)})
            base = len(frames)
            specs.extend({**spec, "frame": base + spec["frame"]} for spec in group.wire_specs)
            frames.extend(group.frames)
        header = {"batch_id": batch_id, "groups": entries, "latest_version": self.latest_version, "tensors": specs}
        self.stats.count("groups", "served", len(groups))
        # framing.pack_raw's layout, with the tensor specs kept as wire dicts from the groups' arrival
        message = [framing.PREAMBLE.pack(framing.MAGIC, protocol.PROTOCOL_VERSION, Kind.BATCH),
                   msgpack.packb(header, use_bin_type=True), *frames]
        self._send_frames(identity, Kind.BATCH, message, on_fail=lambda: self._unserve(batch_id),
                          num_bytes=sum(g.num_bytes for g in groups))
        return True

    def _unserve(self, batch_id: str) -> None:
        for group in self.buffer.unserve(batch_id):
            self.prompts.set_state(group.key, "buffered")
            self.stats.count("groups", "restored")

    def _on_batch_ack(self, identity: bytes, _peer: Peer, ack: protocol.BatchAck, _env: Any, _frames: Any,
                      _now_s: float) -> None:
        listed = set(ack.group_ids)
        groups = self.buffer.ack(ack.batch_id)
        if groups is None and not listed:
            self._reject(identity, "unknown_batch", f"batch {ack.batch_id!r} is unknown to this broker and the ack "
                         "lists no group_ids", ref_kind=Kind.BATCH_ACK, ref_id=ack.batch_id)
            return
        num_trained = 0
        for group in groups or []:
            if listed and group.group_id not in listed:
                self.prompts.requeue(group.key)
                self.stats.count("dropped", "not_trained")
            else:
                num_trained += self.prompts.mark_trained(group.key)
        served = {g.group_id for g in groups or []}
        for group_id in listed - served:
            num_trained += self._mark_trained(group_id)
        self.num_trained_total += num_trained
        self.num_trained_since_start += num_trained
        self.stats.count("groups", "trained", num_trained)
        self.learner_progress.update(step=ack.step, trained_version=ack.trained_version,
                                     checkpoint_version=ack.checkpoint_version)
        self._persist_due = True
        self._send(identity, protocol.Ack(ref_kind=Kind.BATCH_ACK, ref_id=ack.batch_id), after_persist=True)
        self._dirty = True

    def _mark_trained(self, group_id: str) -> int:
        """A group trained from a batch this broker did not serve (it restarted); 1 if it was pending."""
        key = parse_group_id(group_id)
        if key is None or self.prompts.state(key) in ("new", "trained"):
            return 0
        self.buffer.discard(group_id)
        if self.leases.cancel_key(key) is not None:
            self.stats.count("leases", "cancelled")
        return int(self.prompts.mark_trained(key))

    # -- stats -----------------------------------------------------------------------------------------------

    def _on_stats_request(self, identity: bytes, _peer: Peer | None, _request: Any, _env: Any, _frames: Any,
                          now_s: float) -> None:
        self._send(identity, protocol.Stats(snapshot=build_snapshot(self, now_s)))

    # -- timers and flushing ---------------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        """Deadlines: expired leases, dead peers, long-polls due, stats samples."""
        for lease in self.leases.expired(now_s):
            self.prompts.requeue(lease.key)
            self.stats.count("leases", "expired")
            log.info("lease_expired", lease_id=lease.lease_id, group_id=group_id_of(lease.key),
                     worker=lease.worker.decode(errors="replace"))
            self._dirty = True
        if now_s >= self._next_peer_check_s:
            self._next_peer_check_s = now_s + self.config.broker.heartbeat_interval_s * PEER_CHECK_FRACTION
            for peer in self.peers.dead(now_s):
                log.warning("peer_dead", peer=peer.name, silent_s=round(now_s - peer.last_seen_s, 2))
                self._peer_gone(peer, "dead")
        for waiters, answer in ((self.lease_waiters, self._answer_lease_waiter),
                                (self.batch_waiters, self._answer_batch_waiter)):
            if waiters and min(w.deadline_s for w in waiters) <= now_s:
                for waiter in [w for w in waiters if w.deadline_s <= now_s]:
                    waiters.remove(waiter)
                    answer(waiter, now_s, final=True)
        if now_s >= self._next_stats_s:
            self._next_stats_s = now_s + STATS_TICK_S
            self.stats.tick(now_s)
            self._set_gauges()

    def _answer_lease_waiter(self, waiter: Waiter, now_s: float, final: bool) -> bool:
        peer = self.peers.get(waiter.identity)
        if peer is None:
            return True
        return self._try_grant(waiter.identity, peer, waiter.request, now_s, final)

    def _answer_batch_waiter(self, waiter: Waiter, _now_s: float, final: bool) -> bool:
        return self._try_serve(waiter.identity, waiter.request, final)

    def flush(self, now_s: float) -> list[Outgoing]:
        """Write the state if an ack needs it, serve parked long-polls if anything changed; what to send."""
        if self._persist_due:
            self._submit_write()
        self._release_durable()
        while self._dirty:
            self._dirty = False
            if self.batch_waiters:
                self._drop_stale()
            while self.batch_waiters and self._answer_batch_waiter(self.batch_waiters[0], now_s, final=False):
                self.batch_waiters.popleft()
            for waiter in list(self.lease_waiters):
                if self._answer_lease_waiter(waiter, now_s, final=False):
                    self.lease_waiters.remove(waiter)
        out, self.outbox = self.outbox, []
        return out

    def next_wakeup_s(self, now_s: float) -> float:
        """When tick() next has something to do."""
        candidates = [self._next_stats_s, self._next_peer_check_s]
        lease_deadline = self.leases.next_deadline_s()
        if lease_deadline is not None:
            candidates.append(lease_deadline)
        candidates.extend(w.deadline_s for w in self.lease_waiters)
        candidates.extend(w.deadline_s for w in self.batch_waiters)
        return min(candidates)

    def drain(self, now_s: float) -> list[Outgoing]:
        """Shutting down: answer every parked long-poll (empty, reason draining) and write the state."""
        self.draining = True
        for waiter in list(self.lease_waiters):
            self._answer_lease_waiter(waiter, now_s, final=True)
        for waiter in list(self.batch_waiters):
            self._answer_batch_waiter(waiter, now_s, final=True)
        self.lease_waiters.clear()
        self.batch_waiters.clear()
        if self.writer is not None:
            self.writer.close()  # finishes a background write in progress
        self.persist()
        self.outbox.extend(self._unsubmitted)
        for _, replies in self._awaiting_write:
            self.outbox.extend(replies)
        self._unsubmitted, self._awaiting_write = [], deque()
        self._persist_due = False
        out, self.outbox = self.outbox, []
        return out

    def _set_gauges(self) -> None:
        m = self.stats.metrics
        m.set("latest_version", self.latest_version)
        m.set("buffer_groups", self.buffer.num_buffered)
        m.set("buffer_bytes", self.buffer.buffered_bytes)
        m.set("training_groups", self.buffer.num_training)
        m.set("training_bytes", self.buffer.training_bytes)
        m.set("leases_outstanding", len(self.leases))
        m.set("workers", self.peers.num_workers())
        m.set("prompts_queued", self.prompts.num_queued)
        m.set("lease_waiters", len(self.lease_waiters))
        m.set("batch_waiters", len(self.batch_waiters))
