"""The registry of connected clients: who they are, their session, what they last reported, whether alive.

Clients are keyed by their zmq identity (``<role>/<client_id>``, set by :class:`loraflow.common.transport.BrokerLink`;
with CURVE on, ``<role>/<client_id>/<route token>``: a random token per process, so that no other client, even an
authorised one, can claim the identity and with it the messages routed to it). The token is never shown: a
peer's :attr:`Peer.name` and everything stats report use :func:`display_name`.

A client is registered by its Hello and stays registered while it is heard from: any message counts, and
BrokerLink heartbeats every ``heartbeat_interval_s`` regardless of what its process is doing. Silence for
``heartbeat_misses`` intervals means death (:meth:`PeerRegistry.dead`). A Hello with a new ``session`` from a
known ``(role, client_id)``, under the same identity or another one, means the old process died and was
restarted (:meth:`PeerRegistry.hello` returns the old entry so the server can reclaim what it held); the same
session again is a harmless re-hello from the same identity, and refused from another (a connection posing as
the registered process: the learner's probation keys on the process, loraflow.learner.trust).

There is one learner. A learner's Hello replaces any other learner (the newest process wins: a supervisor
restarting a crashed learner must not wait for the old one's heartbeats to time out), and the replaced one is
*fenced*: its identity (every learner process has its own, see :class:`loraflow.common.transport.BrokerLink`) is refused
with ``replaced`` from then on (:meth:`PeerRegistry.fence`), so a learner that was only partitioned or hung
cannot come back and train the same run a second time.

Liveness costs O(1) per message and O(expired) per sweep, whatever the fleet size: the registry keeps its
identities in the order they were last heard (each message moves its sender to the end), so
:meth:`PeerRegistry.dead` reads the silent ones off the front and stops at the first live one. Lookups by
``(role, client_id)`` and the count of each role are indexed too, so a Hello is O(1) and a reconnect storm of n
workers O(n). Callers pass a non-decreasing ``now_s``.

The heartbeat budget. A fleet beating every ``heartbeat_interval_s`` costs the broker one message per worker and
interval whatever it does; past ``broker.max_heartbeats_per_second`` the registry asks for a longer interval
(:attr:`PeerRegistry.interval_s`: the configured one x the fleet's excess, rounded up to a quarter of it), as
Nomad's servers stretch their clients' heartbeat TTL with the cluster's size. Clients hear it in their Welcome
and in pongs (``Heartbeat.interval_s``); one that says it follows (``Hello.heartbeat_interval_s`` > 0) beats at
it and stretches its silence timeout by the same factor, so its pongs are thinned by that factor too
(:meth:`Peer.pong_due`). Death comes after ``heartbeat_misses`` of the asked intervals: the timeout grows at once
when the interval does, and when it shrinks the longer timeout is kept for one more of its own length, until
every follower has heard the shorter interval. Older clients keep their own interval, which is never longer.

Each peer also accumulates the time spent in each reported state (``training``, ``waiting``, ...), from
which the stats derive busy shares (the learner's idle share is the headline number of async training).

The heartbeat fast path (:class:`HeartbeatPath`, which owns a strict decoder and the encoded pong): what a
connected fleet costs the broker when it only says "still here". At 4,096 workers beating every second,
heartbeats are most of the broker's messages, and nearly all of them say what the previous one said. The
general path (:func:`loraflow.common.codec.decode_envelope`, role checks, the typed record, a freshly encoded
pong) costs ~12 us of Python per beat before the sockets; this one costs a few:

    frames == [the Heartbeat preamble, header]      (8 bytes compared: magic, protocol version, kind)
      and the sender is registered, in a role that may beat, its CURVE role (if any) its registered one
      and the header decodes strictly (msgspec, in C, the same field types and bounds as :class:`Heartbeat`)
      with ``counters`` left as raw msgpack: decoded and validated (``Numbers``: <= 64 finite numbers under
      names of <= 64 characters) only when the bytes differ from the ones this peer sent last, which were
      validated then
    -> :meth:`HeartbeatPath.decode` returns the beat; the pong is the pre-encoded one for the latest version

Anything else -- a header the strict decode refuses (bad values, unknown fields, tensors), counters that fail
their bounds, an unregistered or fenced sender, a frame too many -- returns None and the message takes the
general path from the start, which refuses and counts it exactly as before (``rejected{reason}``, the Error
text, ``unknown_fields``). So this path only ever accepts what the general one accepts, and decides nothing
the general one would decide otherwise.

Pure logic: no sockets; callers pass ``now_s`` (``time.monotonic()``).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from loraflow.broker.dispatch import SENDERS
from loraflow.common import codec, framing
from loraflow.common.protocol import PROTOCOL_VERSION, Heartbeat, Hello, Kind, Numbers

MAX_FENCED = 64  # replaced learners remembered (the oldest are forgotten; each is one learner restart)
INTERVAL_STEPS = 4  # a stretched heartbeat interval is rounded up to a quarter of the configured one
SHRINK_MARGIN = 1.1  # ... and made shorter again only once the fleet is a tenth below the shorter one's limit
PONGS_PER_TIMEOUT = 3  # a beat is answered once a third of the client's silence timeout passed since the last answer

#: states in which a client is doing useful work (for busy shares)
BUSY_STATES = frozenset({"generating", "scoring", "training", "publishing"})
_EMPTY_MAP = msgspec.Raw(b"\x80")  # msgpack's empty map: a beat without counters


def display_name(identity: bytes) -> str:
    """``<role>/<client_id>`` of a client identity, without the route token a CURVE client appends (a secret)."""
    return "/".join(identity.decode(errors="replace").split("/")[:2])


class RegistryFull(ValueError):
    """broker.max_workers workers (or broker.max_observers observers) are registered already."""


class ClientIdTaken(ValueError):
    """A Hello claims a (role, client_id) that another CURVE key registered and still holds."""


@dataclass(slots=True, kw_only=True)
class Peer:
    identity: bytes
    role: str
    client_id: str
    session: str
    key: str | None = None  # the CURVE key that registered it ("<role>:<name>"), None without security
    backend: str = ""
    capacity: int = 1
    host: str = ""
    pid: int = 0
    adapter_version: int = 0
    batched_acks: bool = False  # reads Ack.ref_ids: its groups are acknowledged together, once per loop pass
    silence_timeout_s: float = 0.0  # Hello.silence_timeout_s: it says hello again after this long unanswered
    own_interval_s: float = 0.0  # Hello.heartbeat_interval_s: > 0 when it follows the interval the broker asks for
    last_pong_s: float = float("-inf")
    state: str = "starting"
    num_leases_reported: int = 0
    counters: dict[str, Any] = field(default_factory=dict)
    counters_raw: Any = None  # the msgpack bytes ``counters`` was decoded from (HeartbeatPath: unchanged -> kept)
    registered_s: float = 0.0
    registered_unix: float = 0.0
    last_seen_s: float = 0.0
    state_since_s: float = 0.0
    state_time_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    num_groups_accepted: int = 0
    num_groups_rejected: int = 0
    num_leases_granted: int = 0

    @property
    def name(self) -> str:
        return display_name(self.identity)

    def pong_due(self, now_s: float, asked_interval_s: float) -> bool:
        """Whether this beat is answered: always for a client that did not say how long it waits, else once a
        third of its silence timeout has passed since the last answer (a fleet beating every second with the
        default 5-s timeout is answered every second beat: half the broker's sends, and the client still hears
        from it at least every ~2 s). A client that follows the broker's ``asked_interval_s`` has stretched its
        timeout by the factor that interval exceeds its own."""
        silence_s = self.silence_timeout_s
        if self.own_interval_s > 0 and asked_interval_s > self.own_interval_s:
            silence_s *= asked_interval_s / self.own_interval_s
        if silence_s <= 0 or now_s - self.last_pong_s >= silence_s / PONGS_PER_TIMEOUT:
            self.last_pong_s = now_s
            return True
        return False

    def set_state(self, state: str, now_s: float) -> None:
        self.state_time_s[self.state] += max(0.0, now_s - self.state_since_s)
        self.state, self.state_since_s = state, now_s

    def busy_share(self, now_s: float) -> float | None:
        """Share of observed time spent in BUSY_STATES (None before any time was observed)."""
        times = dict(self.state_time_s)
        times[self.state] = times.get(self.state, 0.0) + max(0.0, now_s - self.state_since_s)
        observed = sum(t for s, t in times.items() if s != "starting")
        if observed <= 0:
            return None
        return sum(t for s, t in times.items() if s in BUSY_STATES) / observed


class PeerRegistry:
    """Registered clients by identity, with liveness from the last time each was heard."""

    def __init__(self, *, heartbeat_interval_s: float, heartbeat_misses: int, max_workers: int,
                 max_observers: int = 64, max_heartbeats_per_second: float = 0.0) -> None:
        self.base_interval_s = heartbeat_interval_s
        self.misses = heartbeat_misses
        self.max_heartbeats_per_second = max_heartbeats_per_second
        self.interval_s = heartbeat_interval_s  # asked of the clients now (see "The heartbeat budget")
        self.timeout_s = heartbeat_interval_s * heartbeat_misses
        self._longer_timeout: tuple[float, float] | None = None  # (timeout, kept until) after the interval shrank
        self.max_workers = max_workers
        self.max_observers = max_observers
        self._peers: dict[bytes, Peer] = {}  # in registration order
        self._by_seen: OrderedDict[bytes, None] = OrderedDict()  # the same identities, least recently heard first
        self._by_client: dict[tuple[str, str], dict[bytes, None]] = {}  # (role, client_id) -> identities
        self._num_of_role: dict[str, int] = defaultdict(int)
        self._fenced: OrderedDict[bytes, str] = OrderedDict()  # identity of a replaced learner -> its successor

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, identity: bytes) -> Peer | None:
        return self._peers.get(identity)

    def all(self) -> list[Peer]:
        return list(self._peers.values())

    def of_role(self, role: str) -> list[Peer]:
        return [p for p in self._peers.values() if p.role == role] if self._num_of_role[role] else []

    def worker(self, client_id: str, session: str) -> Peer | None:
        """The registered worker process with this client id and session, if it is connected."""
        peer = self._by_client_id("worker", client_id)
        return peer if peer is not None and peer.session == session else None

    def num_workers(self) -> int:
        return self._num_of_role["worker"]

    def _by_client_id(self, role: str, client_id: str) -> Peer | None:
        """The earliest registered peer with this role and client id."""
        identities = self._by_client.get((role, client_id))
        return self._peers[next(iter(identities))] if identities else None

    def _add(self, peer: Peer) -> None:
        """Register ``peer`` (in the slot of a previous entry of its identity, which must be unindexed first)."""
        self._peers[peer.identity] = peer
        self._by_seen[peer.identity] = None
        self._by_seen.move_to_end(peer.identity)
        self._by_client.setdefault((peer.role, peer.client_id), {})[peer.identity] = None
        self._num_of_role[peer.role] += 1

    def _unindex(self, peer: Peer) -> None:
        key = (peer.role, peer.client_id)
        identities = self._by_client[key]
        del identities[peer.identity]
        if not identities:
            del self._by_client[key]
        self._num_of_role[peer.role] -= 1

    def remove(self, identity: bytes) -> Peer | None:
        peer = self._peers.pop(identity, None)
        if peer is not None:
            del self._by_seen[identity]
            self._unindex(peer)
        return peer

    def hello(self, identity: bytes, hello: Hello, now_s: float, key: str | None = None) -> tuple[Peer, Peer | None]:
        """Register (or refresh) a client; returns (peer, the replaced entry of a previous session or None).
        A client id registered by one CURVE ``key`` cannot be taken over by another while it is registered
        (:class:`ClientIdTaken`): a worker's restart comes with its own key, an impostor's with another."""
        old = self._peers.get(identity)
        if old is not None and old.session == hello.session and old.role == hello.role:
            old.last_seen_s = now_s
            self._by_seen.move_to_end(identity)
            old.adapter_version = max(old.adapter_version, hello.adapter_version)
            old.batched_acks = hello.batched_acks
            return old, None
        if old is None:  # a previous process of the same client under another identity (CURVE route tokens)
            old = self._by_client_id(hello.role, hello.client_id)
            if old is not None and old.key != key and hello.role != "learner":  # (learners: the newest wins)
                raise ClientIdTaken(f"{hello.role} id {hello.client_id!r} is registered by another key; choose "
                                    "another client id (a restarted client uses its own key)")
            if old is not None and old.session == hello.session and hello.role != "learner":
                # a process keeps its connection (identity) for its life, and a restarted one says a new session:
                # this is another connection posing as the registered process (whose trust the learner keys on)
                raise ClientIdTaken(f"{hello.role} id {hello.client_id!r} session {hello.session!r} is held by "
                                    "another connection; a restarted client says a new session")
            if old is not None:
                self.remove(old.identity)
        elif old is not None:  # the same identity with another session or role: a new process, in its slot
            self._unindex(old)
        if old is None and hello.role == "worker" and self.num_workers() >= self.max_workers:
            raise RegistryFull(f"{self.max_workers} workers are registered (broker.max_workers)")
        if old is None and hello.role == "observer" and self._num_of_role["observer"] >= self.max_observers:
            raise RegistryFull(f"{self.max_observers} observers are registered (broker.max_observers); a "
                               "StatsRequest needs no Hello")
        peer = Peer(identity=identity, role=hello.role, client_id=hello.client_id, session=hello.session, key=key,
                    backend=hello.backend, capacity=hello.capacity, host=hello.host, pid=hello.pid,
                    adapter_version=hello.adapter_version, batched_acks=hello.batched_acks,
                    silence_timeout_s=hello.silence_timeout_s, own_interval_s=hello.heartbeat_interval_s,
                    registered_s=now_s, registered_unix=time.time(),
                    last_seen_s=now_s, state_since_s=now_s)
        self._add(peer)
        return peer, old

    def heard(self, identity: bytes, now_s: float) -> Peer | None:
        peer = self._peers.get(identity)
        if peer is not None:
            peer.last_seen_s = now_s
            self._by_seen.move_to_end(identity)
        return peer

    def heartbeat(self, peer: Peer, beat: Heartbeat, now_s: float) -> bool:
        """What a beat reports; True when it changes the peer's adapter version. ``beat.counters`` None: unchanged
        (:class:`HeartbeatPath`, which then keeps ``counters_raw``; a beat decoded the general way clears it)."""
        changed = beat.adapter_version != peer.adapter_version
        peer.adapter_version = beat.adapter_version
        peer.num_leases_reported = beat.num_leases
        if beat.counters is not None:
            peer.counters = beat.counters
            if type(beat) is Heartbeat:
                peer.counters_raw = None
        if beat.state != peer.state:
            peer.set_state(beat.state, now_s)
        return changed

    def fence(self, old: Peer, successor: Peer) -> None:
        """Refuse ``old``'s identity from now on: a learner replaced by ``successor`` must never act again."""
        self.remove(old.identity)
        self._fenced[old.identity] = (f"{successor.name} (session {successor.session}, host {successor.host or '?'}, "
                                      f"pid {successor.pid})")
        while len(self._fenced) > MAX_FENCED:
            self._fenced.popitem(last=False)

    def fenced_by(self, identity: bytes) -> str | None:
        """Who replaced the learner with this identity, or None when it is not fenced."""
        return self._fenced.get(identity)

    def wanted_interval_s(self, margin: float = 1.0) -> float:
        """The interval the heartbeat budget asks for at today's fleet size (times ``margin``)."""
        excess = margin * len(self._peers) / self.max_heartbeats_per_second / self.base_interval_s \
            if self.max_heartbeats_per_second > 0 else 0.0
        return self.base_interval_s * max(1.0, math.ceil(excess * INTERVAL_STEPS) / INTERVAL_STEPS)

    def pace(self, now_s: float) -> bool:
        """Set :attr:`interval_s` and :attr:`timeout_s` for the fleet registered now; True when the interval
        changed."""
        if self._longer_timeout is not None and now_s >= self._longer_timeout[1]:
            self._longer_timeout = None
        wanted = self.wanted_interval_s()
        if wanted < self.interval_s:  # shorter only with room to spare: a fleet at a step's edge does not flap
            wanted = min(self.interval_s, self.wanted_interval_s(SHRINK_MARGIN))
        changed = wanted != self.interval_s
        if wanted < self.interval_s:
            self._longer_timeout = (self.timeout_s, now_s + self.timeout_s)
        self.interval_s = wanted
        self.timeout_s = max(wanted * self.misses, self._longer_timeout[0] if self._longer_timeout else 0.0)
        return changed

    def dead(self, now_s: float) -> list[Peer]:
        """Remove and return the peers silent for longer than the heartbeat timeout, least recently heard first
        (O(expired): the sweep stops at the first peer heard recently enough)."""
        gone = []
        for identity in self._by_seen:
            peer = self._peers[identity]
            if now_s - peer.last_seen_s <= self.timeout_s:
                break
            gone.append(peer)
        for peer in gone:
            self.remove(peer.identity)
        return gone


def _raw_counters_type() -> type:
    """:class:`Heartbeat` with its ``counters`` kept as raw msgpack (every other field, bound and default as is)."""
    fields: list[Any] = []
    for f in msgspec.structs.fields(Heartbeat):
        if f.name == "counters":
            fields.append((f.name, msgspec.Raw, _EMPTY_MAP))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct("RawCountersHeartbeat", fields, kw_only=True, forbid_unknown_fields=True)


class HeartbeatPath:
    """Decodes the common heartbeat cheaply and keeps the pong encoded (see the module docstring)."""

    def __init__(self, max_message_bytes: int) -> None:
        self.preamble = framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, Kind.HEARTBEAT)
        self._max_header_bytes = min(framing.MAX_HEADER_BYTES, max_message_bytes - len(self.preamble))
        self._decoder = msgspec.msgpack.Decoder(_raw_counters_type())
        self._counters = msgspec.msgpack.Decoder(Numbers)
        self._roles = SENDERS[Kind.HEARTBEAT]
        self._pong_of: tuple[int, float] = (-1, 0.0)  # the (latest version, interval) _pong was encoded for
        self._pong: tuple[list[bytes], int] = ([], 0)  # its frames and their bytes

    def decode(self, frames: list[Any], peer: Peer | None, authenticated_role: str | None) -> Any:
        """The beat (``counters`` decoded into ``counters_dict``, or None when unchanged), or None when the message
        must take the general path."""
        if peer is None or len(frames) != 2 or peer.role not in self._roles or (
                authenticated_role is not None and authenticated_role != peer.role):
            return None
        preamble, header = frames[0], frames[1]
        preamble = getattr(preamble, "buffer", preamble)
        header = getattr(header, "buffer", header)
        if preamble != self.preamble or len(header) > self._max_header_bytes:
            return None
        try:
            beat = self._decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
        if beat.tensors:  # (UNSET and [] are both false: the general path accepts both)
            return None
        raw = beat.counters
        if raw == peer.counters_raw:
            beat.counters = None
            return beat
        try:
            counters = self._counters.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
        beat.counters = counters
        peer.counters_raw = raw.copy()  # (not a view of the received frame: that is let go)
        return beat

    def pong(self, latest_version: int, interval_s: float) -> tuple[list[bytes], int]:
        """The broker's Heartbeat reply at ``latest_version``, asking for beats every ``interval_s``, encoded once
        per (version, interval): (frames, bytes)."""
        of = self._pong_of  # (compared field by field: this runs for every answered beat)
        if of[0] != latest_version or of[1] != interval_s:
            frames = codec.encode(Heartbeat(latest_version=latest_version, state="idle", interval_s=interval_s))
            self._pong_of, self._pong = (latest_version, interval_s), (frames, sum(len(f) for f in frames))
        return self._pong
