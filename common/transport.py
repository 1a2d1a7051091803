"""A client's connection to the broker, kept alive by a background I/O thread.

Workers, the learner's rank 0, benchmarks and test clients all talk to the broker through a
:class:`BrokerLink`::

     caller threads                 I/O thread (owns the DEALER socket)                broker
    ---------------   inproc PAIR  ------------------------------------------   tcp   --------
     link.send(m)  ---------------> forward frames (copy=False)          ---------->  ROUTER
     link.recv()   <--- queue ----- decode + validate every message      <----------
                                    heartbeat every interval (state, version, counters)
                                    broker silent past the timeout -> hello again
                                    Welcome with a new broker_id -> Reconnected event

What the I/O thread waits for: the DEALER socket, the inproc pipe from callers, the DEALER's monitor
(handshake failures) and the next heartbeat deadline, in one ``zmq.Poller``. zmq reconnects TCP by itself; the thread only has to notice that the broker
process is a new one (a different ``broker_id`` in its Welcome, or a ``not_registered`` Error) and say hello
again. The caller then gets a :class:`Reconnected` item from :meth:`BrokerLink.recv` and re-sends whatever the
old broker had not acknowledged (the broker deduplicates). The same broker welcoming us again counts too: a
hello sent again after a Welcome (the broker said ``not_registered``, or stayed silent past the timeout: a cut
link) means it declared us dead and re-queued our leases, and what we sent while the link was down may be lost,
so it is re-sent at once rather than waiting for the lease timeout.

Refusals are errors at the caller, with the broker's reason: a Hello answered by an Error (too many workers,
another protocol version, a key not authorised for the role) makes :meth:`BrokerLink.start` raise
:class:`BrokerRefused`; a message larger than the broker's ``max_message_bytes`` (from its Welcome) is not sent,
:meth:`BrokerLink.send` raises :class:`MessageTooLarge` (zmq would otherwise drop the connection silently).

The connection's security handshake is watched too (:class:`HandshakeWatch`, a socket monitor in the same
poll): a key the broker does not authorise, a wrong broker public key, or CURVE on at one side only fail the
handshake before any message can pass, so waiting for a Welcome would only time out. :meth:`BrokerLink.start`
and :func:`fetch_stats` raise :class:`HandshakeFailed` at once instead, saying which of these it is. Without
any answer at all, :meth:`BrokerLink.start` waits ``run.connect_timeout_s``: the broker may start after its
clients (zmq keeps reconnecting and the Hello waits in the socket's queue).

Heartbeats run independently of the caller, so a long generation or training step never looks like a dead
client. Heartbeat pongs are consumed here and only update :attr:`BrokerLink.latest_version` and the interval: a
broker whose fleet is larger than its heartbeat budget asks for a longer one (loraflow.broker.peers), which the link
follows, stretching its silence timeout by the same factor (:meth:`BrokerLink._follow`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from loraflow.common import codec, framing, protocol, sockets
from loraflow.common.codes import ProtocolError
from loraflow.common.framing import Envelope
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Error, Heartbeat, Hello, Kind, Welcome

log = get_logger("transport")
_link_ids = itertools.count()


class BrokerUnavailable(TimeoutError):
    """The broker did not answer in time; the message names the setting to raise."""


class HandshakeFailed(BrokerUnavailable):
    """The security handshake with the broker failed (keys that do not match, security on at one side only):
    the broker is there, but this client cannot talk to it until a setting changes; the message says which."""


class BrokerRefused(ConnectionError):
    """The broker answered the Hello with an Error (protocol version, too many workers, a key not authorised
    for the role): waiting will not help; the message is the broker's, saying what to change."""


#: What libzmq 4.3.5 reports on a client's monitor (seen on loopback with pyzmq 27, against the real broker): a
#: key the broker's ZAP handler refuses -> HANDSHAKE_FAILED_AUTH (value: the ZAP status, 400), and zmq does not
#: reconnect; a broker public key that is not the broker's -> the broker cannot open the client's HELLO and
#: drops the connection (its monitor: PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC), the client sees
#: HANDSHAKE_FAILED_NO_DETAIL (EPIPE) and retries every reconnect interval; CURVE on one side only ->
#: HANDSHAKE_FAILED_PROTOCOL with MECHANISM_MISMATCH (no reconnect) in about 2 of 3 attempts, and in the others
#: the same NO_DETAIL as a wrong key (whichever side notices first hangs up), so a run of those names both.
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
#: handshakes dropped without detail, in a row, before a CURVE client blames the broker key (one can be a
#: broker dying mid-handshake; zmq retries every ~100 ms)
NUM_DROPPED_HANDSHAKES = 3


class HandshakeWatch:
    """A client socket's monitor, read for handshake failures; :meth:`read` returns what is wrong once sure."""

    def __init__(self, sock: zmq.Socket, *, curve: bool, role: str) -> None:
        self.monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self._sock = sock
        self._curve = curve
        self._role = role
        self._num_dropped = 0

    def read(self) -> str | None:
        """Drain the monitor; the diagnosis of a handshake that cannot succeed, else None."""
        problem = None
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return problem
            problem = self._diagnose(event["event"], event["value"]) or problem

    def _diagnose(self, event: int, value: int) -> str | None:
        role = self._role if self._role in ("worker", "learner", "observer") else "worker"
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._num_dropped = 0
            return None
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"the broker refused this client's key in the CURVE handshake (ZAP status {value}): the keys "
                    f"do not match, this public key is not under the broker's security.keys_dir/authorized/{role}/ "
                    f"(the broker's log names the key file when it has it); authorise it there with `loraflow "
                    f"keys DIR --{role} NAME`, or use a pair from the broker's keys dir here (security.keys_dir, "
                    "security.client_key)")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self._curve:
                return ("security is on here (security.enabled = true: CURVE) but off at the broker; "
                        "security.enabled must be the same on every machine of the run")
            return ("the broker requires CURVE (security.enabled = true there) but security is off here: set "
                    "security.enabled = true, security.keys_dir and security.client_key in this client's config")
        self._num_dropped += 1
        if self._num_dropped < NUM_DROPPED_HANDSHAKES:
            return None
        if self._curve:
            return (f"the broker dropped {self._num_dropped} CURVE handshakes in a row: the broker public key here "
                    "(security.keys_dir/broker.key) is not this broker's (keys from another `loraflow keys` "
                    "directory? copy broker.key from the broker's keys dir), or security is off at the broker "
                    "(security.enabled must be the same on every machine of the run)")
        return (f"the broker dropped {self._num_dropped} handshakes in a row: it probably requires CURVE "
                "(security.enabled = true there) while security is off here: set security.enabled = true, "
                "security.keys_dir and security.client_key in this client's config")

    def close(self) -> None:
        self._sock.disable_monitor()
        self.monitor.close(linger=0)


def watched_dealer(ctx: zmq.Context, endpoint: str, *, identity: bytes, security: Any,
                   role: str) -> tuple[zmq.Socket, HandshakeWatch]:
    """A DEALER to the broker and its :class:`HandshakeWatch`, the monitor attached before the socket connects:
    zmq does not retry a mechanism mismatch, so on a busy machine a handshake that fails before a monitor is
    attached leaves no event at all, and the client would wait out its whole connect timeout undiagnosed."""
    sock = sockets.dealer_socket(ctx, endpoint, identity=identity, security=security, connect=False)
    watch = HandshakeWatch(sock, curve=security is not None, role=role)
    sock.connect(endpoint)
    return sock, watch


class MessageTooLarge(ValueError):
    """A message is larger than the broker accepts (``broker.max_message_bytes``, told in its Welcome)."""


@dataclass(slots=True)
class Incoming:
    """A message from the broker: the typed record and its envelope (tensor specs and frames), and when the
    link's thread received it (``time.monotonic()``; the owner may read its inbox much later)."""

    record: Any
    envelope: Envelope
    received_at: float = field(default_factory=time.monotonic)

    @property
    def kind(self) -> Kind:
        return Kind(self.envelope.kind)


@dataclass(slots=True)
class Reconnected:
    """The broker restarted, forgot us, or welcomed us back after a silence; re-send anything it has not
    acknowledged."""

    welcome: Welcome


class BrokerLink:
    """A DEALER connection to the broker with hello, heartbeats and reconnects handled in the background."""

    def __init__(self, endpoint: str, hello: Hello, *, ctx: zmq.Context | None = None, security: Any = None,
                 heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 5.0,
                 max_message_bytes: int = 1 << 31) -> None:
        if not hello.session:
            hello.session = uuid.uuid4().hex[:12]
        hello.host = hello.host or socket.gethostname()
        hello.pid = hello.pid or os.getpid()
        hello.silence_timeout_s = hello.silence_timeout_s or heartbeat_timeout_s
        hello.heartbeat_interval_s = heartbeat_interval_s  # it follows a longer interval the broker asks for
        self.endpoint = endpoint
        self.hello = hello
        self.welcome: Welcome | None = None
        self.latest_version = 0
        self.heartbeat = Heartbeat(adapter_version=hello.adapter_version, state="starting")
        self.num_decode_errors = 0
        self.num_reconnects = 0
        self._ctx = ctx or zmq.Context.instance()
        self._security = security
        self._route_token = secrets.token_hex(16) if security is not None or hello.role == "learner" else ""
        self._own_interval_s, self._own_timeout_s = heartbeat_interval_s, heartbeat_timeout_s
        self._interval_s = heartbeat_interval_s  # the own one, or the longer one the broker asks for (_follow)
        self._timeout_s = heartbeat_timeout_s  # stretched by the same factor
        self._max_bytes = max_message_bytes
        self._inbox: queue.Queue[Incoming | Reconnected] = queue.Queue()
        self._held: collections.deque[Incoming | Reconnected] = collections.deque()
        self._welcomed = threading.Event()
        self._rejoining = False  # a hello went out again after a Welcome: its answer is a Reconnected too
        self._answered = threading.Event()  # a Welcome, or an Error refusing the Hello
        self._refusal: Error | None = None
        self._handshake_problem: str | None = None  # a handshake that cannot succeed (HandshakeWatch)
        self._closed = False
        self._stop = threading.Event()
        self._send_lock = threading.Lock()
        pipe_name = f"inproc://broker-link-{os.getpid()}-{next(_link_ids)}"
        self._pipe_io = self._ctx.socket(zmq.PAIR)
        self._pipe_io.bind(pipe_name)
        self._pipe = self._ctx.socket(zmq.PAIR)
        self._pipe.connect(pipe_name)
        self._thread = threading.Thread(target=self._run, name=f"broker-link-{hello.client_id}", daemon=True)

    # -- caller side -----------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> Welcome:
        """Connect, say hello and wait up to ``timeout_s`` (``run.connect_timeout_s``) for the Welcome; raises
        HandshakeFailed as soon as the security handshake cannot succeed."""
        self._thread.start()
        if not self._answered.wait(timeout_s):
            self.close(send_bye=False)
            raise BrokerUnavailable(f"no Welcome from the broker at {self.endpoint} within {timeout_s:g} s "
                                    "(run.connect_timeout_s): is it running and is broker.endpoint right? Nothing "
                                    "answered at all (keys that do not match, or security.enabled on at one side "
                                    "only, are reported at once); raise run.connect_timeout_s if it is just slow "
                                    "to start")
        if self._handshake_problem is not None:
            self.close(send_bye=False)
            raise HandshakeFailed(f"cannot talk to the broker at {self.endpoint} as this {self.hello.role}: "
                                  f"{self._handshake_problem}")
        if self._refusal is not None:
            self.close(send_bye=False)
            raise BrokerRefused(f"the broker at {self.endpoint} refused this {self.hello.role} "
                                f"({self._refusal.code}): {self._refusal.message}")
        assert self.welcome is not None
        return self.welcome

    def send(self, message: Any, tensors: Iterable[tuple[str, Any]] = ()) -> None:
        """Queue a message for the broker (thread-safe; tensors are sent zero-copy, do not mutate them)."""
        self.send_frames(codec.encode(message, list(tensors)))

    def send_frames(self, frames: list[Any]) -> None:
        """Queue encoded frames; raises MessageTooLarge (nothing sent) when the broker would refuse the size."""
        limit = self.welcome.max_message_bytes if self.welcome is not None else self._max_bytes
        size = sum(memoryview(f).nbytes for f in frames)
        if size > limit:
            kind = framing.PREAMBLE.unpack(memoryview(frames[0]))[2]
            name = Kind(kind).name if kind in protocol.KNOWN_KINDS else f"kind-{kind}"
            raise MessageTooLarge(f"a {name} message of {size} bytes exceeds the broker's limit of {limit} bytes "
                                  "(broker.max_message_bytes): raise it on the broker, or make the message smaller")
        with self._send_lock:
            self._pipe.send_multipart(frames, copy=False)

    def recv(self, timeout_s: float | None = None, kinds: Iterable[Kind] | None = None) -> Incoming | Reconnected | None:
        """The next message (or Reconnected); with ``kinds``, others are held back for later calls."""
        wanted = None if kinds is None else {int(k) for k in kinds}

        def matches(item: Incoming | Reconnected) -> bool:
            return wanted is None or isinstance(item, Reconnected) or item.envelope.kind in wanted

        for item in list(self._held):
            if matches(item):
                self._held.remove(item)
                return item
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._inbox.get(timeout=remaining)
            except queue.Empty:
                return None
            if matches(item):
                return item
            self._held.append(item)

    def set_state(self, state: str | None = None, *, adapter_version: int | None = None,
                  num_leases: int | None = None, lease_ids: list[str] | None = None, **counters: Any) -> None:
        """What the next heartbeat reports (state, adapter version, the leases still in progress, which the broker
        renews, and counters shown by `loraflow status`)."""
        if state is not None:
            self.heartbeat.state = state
        if lease_ids is not None:
            self.heartbeat.lease_ids = lease_ids
        if adapter_version is not None:
            self.heartbeat.adapter_version = adapter_version
        if num_leases is not None:
            self.heartbeat.num_leases = num_leases
        if counters:
            self.heartbeat.counters = {**self.heartbeat.counters, **counters}

    def close(self, reason: str = "", send_bye: bool = True) -> None:
        """Say goodbye (optionally), stop the I/O thread and close the sockets; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            if send_bye:
                self.send(protocol.Bye(reason=reason))
            with self._send_lock:
                self._pipe.send_multipart([b""])  # an empty frame tells the I/O thread to stop
            self._thread.join(timeout=5)
        elif self._thread.ident is None:  # never started: the I/O thread's end of the pipe is ours to close
            self._pipe_io.close(linger=0)
        self._pipe.close(linger=0)

    # -- I/O thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        dealer, watch = watched_dealer(self._ctx, self.endpoint, identity=self._identity(), security=self._security,
                                       role=self.hello.role)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pipe_io, zmq.POLLIN)
        poller.register(watch.monitor, zmq.POLLIN)
        now = time.monotonic()
        last_heard = last_hello = now
        next_beat = now + self._interval_s

        def send_own(message: Any) -> None:
            """A hello or heartbeat: dropped when zmq has no connection to queue it for (after a failed
            handshake zmq may drop the pipe; a blocking send would hang this thread and close())."""
            with contextlib.suppress(zmq.Again):
                dealer.send_multipart(codec.encode(message), flags=zmq.NOBLOCK)

        send_own(self.hello)
        try:
            while True:
                timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000))
                events = dict(poller.poll(timeout_ms))
                if self._pipe_io in events:
                    frames = self._pipe_io.recv_multipart(copy=False)
                    if len(frames) == 1 and len(frames[0]) == 0:
                        break
                    dealer.send_multipart(frames, copy=False)
                if watch.monitor in events:
                    self._on_handshake_problem(watch.read())
                if dealer in events:
                    last_heard = time.monotonic()
                    while True:
                        try:
                            frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if self._handle(frames):
                            send_own(self.hello)
                            self._rejoining = True
                            last_hello = time.monotonic()
                now = time.monotonic()
                if now >= next_beat:
                    if self._welcomed.is_set():
                        send_own(self.heartbeat)
                    next_beat = now + self._interval_s
                silent_s = now - last_heard
                if silent_s > self._timeout_s and now - last_hello > self._timeout_s:
                    log.warning("broker_silent", silent_s=round(silent_s, 1), endpoint=self.endpoint)
                    send_own(self.hello)
                    self._rejoining = self._welcomed.is_set()
                    last_hello = now
        finally:
            watch.close()
            dealer.close(linger=sockets.LINGER_MS)
            self._pipe_io.close(linger=0)

    def _on_handshake_problem(self, problem: str | None) -> None:
        """Before the Welcome, a handshake that cannot succeed ends start(); after it, it is logged (once)."""
        if problem is None or problem == self._handshake_problem:
            return
        if not self._welcomed.is_set():
            self._handshake_problem = problem
            self._answered.set()
        else:
            self._handshake_problem = problem
            log.warning("broker_handshake_failed", endpoint=self.endpoint, why=problem)

    @property
    def heartbeat_interval_s(self) -> float:
        """The interval this link beats at now."""
        return self._interval_s

    def _follow(self, asked_s: float) -> None:
        """Beat at the interval the broker asks for when it is longer than our own (its heartbeat budget for a large
        fleet, loraflow.broker.peers), and wait for its answers longer by the same factor: it thins its pongs by it. 0 (an
        older broker's pong) asks for nothing."""
        if asked_s <= 0:
            return
        interval_s = max(self._own_interval_s, asked_s)
        if interval_s != self._interval_s:
            log.info("heartbeat_interval_followed", interval_s=interval_s, own_interval_s=self._own_interval_s)
            self._interval_s = interval_s
            self._timeout_s = self._own_timeout_s * interval_s / self._own_interval_s

    def _identity(self) -> bytes:
        """``<role>/<client_id>`` (``@<run>`` after it for a pool run's client); with CURVE, plus a random route token: an identity another authorised client
        cannot guess, so it cannot take over this client's route (zmq hands an identity to its newest holder).
        A learner always has one: a second learner process gets another route, so the broker can tell the two
        apart and fence the one it replaced."""
        run = f"@{self.hello.run}" if self.hello.run else ""  # a pool run's clients: apart from other runs' namesakes
        base = f"{self.hello.role}/{self.hello.client_id}{run}"[:200]
        return (f"{base}/{self._route_token}" if self._route_token else base).encode()

    def _handle(self, frames: list[Any]) -> bool:
        """Route one message from the broker; returns True when a hello must be sent again."""
        try:
            record, envelope = codec.decode(frames, self._max_bytes)
        except ProtocolError as exc:
            self.num_decode_errors += 1
            log.warning("bad_message_from_broker", error=str(exc))
            return False
        if isinstance(record, Error) and record.ref_kind == Kind.HELLO and not self._welcomed.is_set():
            self._refusal = record  # start() raises BrokerRefused with the broker's reason
            self._answered.set()
            return False
        if isinstance(record, Welcome):
            previous = self.welcome
            self.welcome = record
            self.latest_version = max(self.latest_version, record.latest_version)
            rejoined, self._rejoining = self._rejoining, False
            if previous is not None and (previous.broker_id != record.broker_id or rejoined):
                self.num_reconnects += 1
                log.info("broker_restarted" if previous.broker_id != record.broker_id else "broker_rejoined",
                         broker_id=record.broker_id)
                self._inbox.put(Reconnected(record))
            self._follow(record.heartbeat_interval_s)
            self._welcomed.set()
            self._answered.set()
            return False
        if isinstance(record, Heartbeat):
            self.latest_version = max(self.latest_version, record.latest_version)
            self._follow(record.interval_s)
            return False
        if isinstance(record, Error) and record.code == "not_registered":
            return True
        self._inbox.put(Incoming(record, envelope))
        return False


def fetch_stats(endpoint: str, *, timeout_s: float = 5.0, ctx: zmq.Context | None = None,
                security: Any = None, run: str = "") -> dict[str, Any]:
    """One StatsRequest to the broker without registering (of the pool run ``run``; "" = the broker's own);
    returns the snapshot (see :func:`ask`)."""
    return ask(endpoint, protocol.StatsRequest(run=run), protocol.Stats, what="stats", timeout_s=timeout_s, ctx=ctx,
               security=security).snapshot


def ask(endpoint: str, record: Any, reply_type: type, *, what: str, timeout_s: float = 5.0,
        ctx: zmq.Context | None = None, security: Any = None) -> Any:
    """Send one message as an unregistered observer and return the broker's ``reply_type`` answer; raises
    BrokerUnavailable without one in time (HandshakeFailed when the keys or security settings do not match the
    broker's) and ProtocolError (its code) when the broker refuses."""
    ctx = ctx or zmq.Context.instance()
    sock, watch = watched_dealer(ctx, endpoint, identity=f"observer/{uuid.uuid4().hex[:8]}".encode(),
                                 security=security, role="observer")
    try:
        sock.send_multipart(codec.encode(record))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(watch.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while sock not in (events := dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))):
            problem = watch.read() if watch.monitor in events else None
            if problem is not None:
                raise HandshakeFailed(f"cannot talk to the broker at {endpoint}: {problem}")
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"no {what} from the broker at {endpoint} within {timeout_s:g} s (is it "
                                        "running? raise --timeout if it is busy; the keys may not match or "
                                        "security.enabled may differ from the broker's)")
        reply, _ = codec.decode(sock.recv_multipart(copy=False))
        if isinstance(reply, Error):
            raise ProtocolError(f"broker refused the {what} request: {reply.message}", code=reply.code)
        if not isinstance(reply, reply_type):
            raise ProtocolError(f"expected {reply_type.__name__}, got {type(reply).__name__}")
        return reply
    finally:
        watch.close()
        sock.close(linger=0)
