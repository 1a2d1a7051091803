"""The registry of connected clients: who they are, their session, what they last reported, whether alive.

Clients are keyed by their zmq identity (``<role>/<client_id>``, set by :class:`common.transport.BrokerLink`;
with CURVE on, ``<role>/<client_id>/<route token>``: a random token per process, so that no other client, even an
authorised one, can claim the identity and with it the messages routed to it). The token is never shown: a
peer's :attr:`Peer.name` and everything stats report use :func:`display_name`.

A client is registered by its Hello and stays registered while it is heard from: any message counts, and
BrokerLink heartbeats every ``heartbeat_interval_s`` regardless of what its process is doing. Silence for
``heartbeat_misses`` intervals means death (:meth:`PeerRegistry.dead`). A Hello with a new ``session`` from a
known ``(role, client_id)``, under the same identity or another one, means the old process died and was
restarted (:meth:`PeerRegistry.hello` returns the old entry so the server can reclaim what it held); the same
session again is a harmless re-hello.

There is one learner. A learner's Hello replaces any other learner (the newest process wins: a supervisor
restarting a crashed learner must not wait for the old one's heartbeats to time out), and the replaced one is
*fenced*: its identity (every learner process has its own, see :class:`common.transport.BrokerLink`) is refused
with ``replaced`` from then on (:meth:`PeerRegistry.fence`), so a learner that was only partitioned or hung
cannot come back and train the same run a second time.

Each peer also accumulates the time spent in each reported state (``training``, ``waiting``, ...), from
which the stats derive busy shares (the learner's idle share is the headline number of async training).
Pure logic: no sockets; callers pass ``now_s`` (``time.monotonic()``).
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

from common.protocol import Heartbeat, Hello

MAX_FENCED = 64  # replaced learners remembered (the oldest are forgotten; each is one learner restart)

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
    state: str = "starting"
    num_leases_reported: int = 0
    counters: dict[str, Any] = field(default_factory=dict)
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
                 max_observers: int = 64) -> None:
        self.timeout_s = heartbeat_interval_s * heartbeat_misses
        self.max_workers = max_workers
        self.max_observers = max_observers
        self._peers: dict[bytes, Peer] = {}
        self._fenced: OrderedDict[bytes, str] = OrderedDict()  # identity of a replaced learner -> its successor

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, identity: bytes) -> Peer | None:
        return self._peers.get(identity)

    def all(self) -> list[Peer]:
        return list(self._peers.values())

    def of_role(self, role: str) -> list[Peer]:
        return [p for p in self._peers.values() if p.role == role]

    def worker(self, client_id: str, session: str) -> Peer | None:
        """The registered worker process with this client id and session, if it is connected."""
        return next((p for p in self._peers.values()
                     if p.role == "worker" and (p.client_id, p.session) == (client_id, session)), None)

    def num_workers(self) -> int:
        return sum(1 for p in self._peers.values() if p.role == "worker")

    def hello(self, identity: bytes, hello: Hello, now_s: float, key: str | None = None) -> tuple[Peer, Peer | None]:
        """Register (or refresh) a client; returns (peer, the replaced entry of a previous session or None).
        A client id registered by one CURVE ``key`` cannot be taken over by another while it is registered
        (:class:`ClientIdTaken`): a worker's restart comes with its own key, an impostor's with another."""
        old = self._peers.get(identity)
        if old is not None and old.session == hello.session and old.role == hello.role:
            old.last_seen_s = now_s
            old.adapter_version = max(old.adapter_version, hello.adapter_version)
            old.batched_acks = hello.batched_acks
            return old, None
        if old is None:  # a previous process of the same client under another identity (CURVE route tokens)
            old = next((p for p in self._peers.values() if (p.role, p.client_id) == (hello.role, hello.client_id)),
                       None)
            if old is not None and old.key != key and hello.role != "learner":  # (learners: the newest wins)
                raise ClientIdTaken(f"{hello.role} id {hello.client_id!r} is registered by another key; choose "
                                    "another client id (a restarted client uses its own key)")
            if old is not None:
                del self._peers[old.identity]
        if old is None and hello.role == "worker" and self.num_workers() >= self.max_workers:
            raise RegistryFull(f"{self.max_workers} workers are registered (broker.max_workers)")
        if old is None and hello.role == "observer" and len(self.of_role("observer")) >= self.max_observers:
            raise RegistryFull(f"{self.max_observers} observers are registered (broker.max_observers); a "
                               "StatsRequest needs no Hello")
        peer = Peer(identity=identity, role=hello.role, client_id=hello.client_id, session=hello.session, key=key,
                    backend=hello.backend, capacity=hello.capacity, host=hello.host, pid=hello.pid,
                    adapter_version=hello.adapter_version, batched_acks=hello.batched_acks,
                    registered_s=now_s, registered_unix=time.time(),
                    last_seen_s=now_s, state_since_s=now_s)
        self._peers[identity] = peer
        return peer, old

    def heard(self, identity: bytes, now_s: float) -> Peer | None:
        peer = self._peers.get(identity)
        if peer is not None:
            peer.last_seen_s = now_s
        return peer

    def heartbeat(self, peer: Peer, beat: Heartbeat, now_s: float) -> None:
        peer.adapter_version = beat.adapter_version
        peer.num_leases_reported = beat.num_leases
        peer.counters = beat.counters
        if beat.state != peer.state:
            peer.set_state(beat.state, now_s)

    def remove(self, identity: bytes) -> Peer | None:
        return self._peers.pop(identity, None)

    def fence(self, old: Peer, successor: Peer) -> None:
        """Refuse ``old``'s identity from now on: a learner replaced by ``successor`` must never act again."""
        self._peers.pop(old.identity, None)
        self._fenced[old.identity] = (f"{successor.name} (session {successor.session}, host {successor.host or '?'}, "
                                      f"pid {successor.pid})")
        while len(self._fenced) > MAX_FENCED:
            self._fenced.popitem(last=False)

    def fenced_by(self, identity: bytes) -> str | None:
        """Who replaced the learner with this identity, or None when it is not fenced."""
        return self._fenced.get(identity)

    def dead(self, now_s: float) -> list[Peer]:
        """Remove and return the peers silent for longer than the heartbeat timeout."""
        gone = [p for p in self._peers.values() if now_s - p.last_seen_s > self.timeout_s]
        for peer in gone:
            del self._peers[peer.identity]
        return gone
