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
``(role, client_id)`` and the count of each role are indexed too, so a Hello is O(1) (a reconnect storm of n
workers was O(n^2)). Callers pass a non-decreasing ``now_s``.

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
Pure logic: no sockets; callers pass ``now_s`` (``time.monotonic()``).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

from loraflow.common.protocol import Heartbeat, Hello

MAX_FENCED = 64  # replaced learners remembered (the oldest are forgotten; each is one learner restart)
INTERVAL_STEPS = 4  # a stretched heartbeat interval is rounded up to a quarter of the configured one
SHRINK_MARGIN = 1.1  # ... and made shorter again only once the fleet is a tenth below the shorter one's limit
PONGS_PER_TIMEOUT = 3  # a beat is answered once a third of the client's silence timeout passed since the last answer

#: states in which a client is doing useful work (for busy shares)
BUSY_STATES = frozenset({"generating", "scoring", "training", "publishing"})


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
    counters_raw: Any = None  # the msgpack bytes ``counters`` was decoded from (loraflow.broker.heartbeats: unchanged -> kept)
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
        (:mod:`loraflow.broker.heartbeats`, which then keeps ``counters_raw``; a beat decoded the general way clears it)."""
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
