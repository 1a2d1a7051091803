"""The broker's event loop: one ROUTER socket, one thread, zmq frames in and out untouched.

::

     workers  (DEALER) --+                                    +--> LeaseGrant, Ack, AdapterNotice,
     learner  (DEALER) --+--> ROUTER --recv (NOBLOCK, batch)--+      AdapterUpdate (forwarded frames), Error
     status   (DEALER) --+      ^                              |    Batch (forwarded frames), Welcome, Stats
                                |                              v
                                |      BrokerCore.handle(identity, frames)   per message, pure state
                                |      BrokerCore.tick(now)      lease deadlines, dead peers, long-poll
                                |                                deadlines, stats samples
                                |      BrokerCore.flush(now)     state file write (group commit of acks),
                                |                                parked long-polls served if state changed
                                +---- send_multipart(NOBLOCK, copy=False) <- outbox
                                      refused (peer gone / queue full) -> BrokerCore.send_failed: undo

What it consumes: every client message on the ROUTER (Hello, Heartbeat, LeaseRequest, RolloutGroup,
LeaseReturn, AdapterFetch, AdapterUpdate, BatchRequest, BatchAck, StatsRequest, Bye) and the socket
monitor's connect/disconnect events.

What it produces: replies and forwarded frames on the same ROUTER, the state file and the newest adapter on
disk (written by a helper thread, :class:`loraflow.broker.state.StateWriter`, whose "durable" signal arrives on a pipe
in the same poll, so acks that depend on a write wait for it without stalling the loop), Prometheus gauges.

A bug in a handler's validation costs one message (Error ``internal``); one in its apply half
(:class:`loraflow.broker.dispatch.HalfApplied`) ends the process, exit 1, before the half-applied state is written
(the supervisor restarts the broker on its last state file).

What it blocks on: ``zmq.Poller.poll`` only, with the timeout set to the core's next deadline (capped at
``MAX_POLL_MS`` so a stop request is noticed promptly). What unblocks it: an incoming message, a durable
write, a deadline, or :meth:`BrokerServer.stop` (the signal handler). Sends never block: with
``ROUTER_MANDATORY`` a peer that is gone (EHOSTUNREACH) or whose queue is full (EAGAIN) makes the send fail
at once, and the core takes back what the message promised (leases re-queued, a batch back to the buffer).
With CURVE (``security.enabled``) every message carries the role its sender's key is authorised for, and
the core lets a client act only in that role. Handshakes that fail never reach the socket; they are counted
by cause (``auth{...}``): ``refused`` (a key not authorised: the ZAP thread's count, logged with the key's file
when the keys dir has it), ``wrong_server_key`` (the client's broker public key is not ours: the monitor's
HANDSHAKE_FAILED_PROTOCOL with ZMTP_CRYPTOGRAPHIC), ``plaintext`` (a client without CURVE) or ``curve_client``
(a CURVE client when security is off: both MECHANISM_MISMATCH), ``dropped`` (the client hung up mid-handshake,
HANDSHAKE_FAILED_NO_DETAIL: libzmq 4.3.5 reports a plaintext client so when the client notices the mismatch
first, which happens on a busy machine), ``handshake_failed`` (anything else).

Up to ``MAX_DRAIN`` messages, for at most ``MAX_DRAIN_S``, are received per wake-up before timers and sends
run, which amortises the poll and the state-file write over a burst without letting a burst (thousands of
heartbeats after a stall) hold up the reply to a LeaseRequest queued behind it; tensor frames are received with
``copy=False`` and forwarded as the same ``zmq.Frame`` objects. The common heartbeat takes a fast path
(:class:`loraflow.broker.peers.HeartbeatPath`), and a publish's AdapterNotices to every worker are handed out in
paced batches (:data:`loraflow.broker.adapters.NOTICE_BATCH` every :data:`loraflow.broker.adapters.NOTICE_SPACING_S`),
so neither a large idle fleet nor a fan-out stalls the loop or the replies queued behind it in zmq's I/O thread.
Each pass's time and its slowest step are kept by :class:`loraflow.broker.stats.LoopTimes` (Stats ``loop``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from loraflow.broker.core import BrokerCore
from loraflow.broker.dispatch import HalfApplied
from loraflow.broker.peers import display_name
from loraflow.broker.pool import BrokerPool
from loraflow.common import sockets
from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.security import role_of

log = get_logger("broker")

MAX_DRAIN = 512
MAX_DRAIN_S = 0.005  # a pass stops receiving after this long (then sends, and polls again at once)
MAX_POLL_MS = 100
#: when messages arrive more often than one per GATHER_S, a pass that handled a single message and left nothing
#: to do is followed by a wait of GATHER_S before the next poll, so a fleet's heartbeats (4,096 a second arrive
#: one at a time) are read a dozen per pass: the pass's fixed cost (poll, tick, flush, the I/O thread's wake-ups)
#: is shared instead of paid per beat. It delays such a message by at most this much; a quiet broker (a small
#: fleet, a learner alone) never waits.
GATHER_S = 0.003
MONITOR_EVENTS = {zmq.EVENT_ACCEPTED: "accepted", zmq.EVENT_DISCONNECTED: "disconnected"}
#: handshake failures on the monitor, by cause (HANDSHAKE_FAILED_AUTH is counted by the ZAP thread instead)
HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
HANDSHAKE_LOG_INTERVAL_S = 10.0  # a client with a wrong broker key retries every ~100 ms: log a cause this often


def _user_id(frame: Any) -> str | None:
    """The ZAP User-Id (``<role>:<key name>``) CURVE attached to a received frame, None without one."""
    try:
        return frame.get("User-Id") or None
    except (zmq.ZMQError, AttributeError):
        return None


class BrokerServer:
    """Binds the ROUTER and runs the loop until :meth:`stop`."""

    def __init__(self, config: Config, core: BrokerCore | BrokerPool, *, ctx: zmq.Context | None = None,
                 security: Any = None) -> None:
        self.pool = core if isinstance(core, BrokerPool) else BrokerPool(core)  # a core alone: a pool of one run
        self.ctx = ctx or sockets.make_context()
        self.security = security
        if security is not None:
            security.start(self.ctx)  # the ZAP authenticator must run before the socket binds
        self.sock, self.bound_endpoint = sockets.router_socket(
            self.ctx, config.bind_endpoint, max_message_bytes=config.broker.max_message_bytes, security=security)
        self.endpoint = sockets.connect_endpoint(self.bound_endpoint)
        self.monitor = self.sock.get_monitor_socket(sum(MONITOR_EVENTS) | HANDSHAKE_FAILURES)
        self.pool.stats.encryption = "curve" if security is not None else "off"
        self._handshake_logged: dict[str, tuple[float, int]] = {}  # cause -> (last logged at, count then)
        self._wake_r, self._wake_w = os.pipe()  # the state writer's "write is durable" signal
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.pool.set_on_durable(self._wake)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._stop_requested = False  # set by stop(), also before serve() began (a SIGTERM during startup)
        self._refused_counted = 0

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the loop
            os.write(self._wake_w, b"w")

    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler; before serve() too: it then returns at once)."""
        self._stop_requested = True

    def serve(self) -> None:
        """Run until stop(); then answer parked long-polls, write the state and close."""
        pool = self.pool
        loop_times = pool.loop_times
        gc.callbacks.append(loop_times.on_gc)
        own = pool.default
        log.info("broker_serving", endpoint=self.endpoint, broker_id=own.broker_id,
                 latest_version=own.latest_version, capacity_groups=own.capacity_groups)
        last_ended = 0.0
        try:
            while not self._stop_requested:
                now_s = time.monotonic()
                if pool.has_work(now_s):
                    timeout_ms = 0
                else:
                    timeout_ms = min(MAX_POLL_MS, max(0, int((pool.next_wakeup_s(now_s) - now_s) * 1000) + 1))
                events = dict(self.poller.poll(timeout_ms))
                started, started_cpu = time.perf_counter(), time.thread_time()
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if self.monitor in events:
                    self._read_monitor()
                handled = self._receive() if self.sock in events else 0
                now_s = time.monotonic()
                self._count_refused_handshakes()
                ticked = time.perf_counter()
                pool.tick(now_s)
                flushed = time.perf_counter()
                self._send_all(pool.flush(now_s))
                ended = time.perf_counter()
                loop_times.step("tick", flushed - ticked)
                loop_times.step("flush", ended - flushed)
                loop_times.pass_done(ended - started, time.thread_time() - started_cpu)
                waited, last_ended = started - last_ended, ended  # how long the loop had nothing to do before
                if handled == 1 and waited < GATHER_S and not pool.has_work(now_s):
                    time.sleep(GATHER_S)
            self._send_all(pool.drain(time.monotonic()))
            log.info("broker_stopped", latest_version=own.latest_version, cursor=list(own.ledger.source.cursor),
                     num_runs=len(pool.cores))
        finally:
            gc.callbacks.remove(loop_times.on_gc)
            self.close()

    def _receive(self) -> int:
        """Handle what has arrived, within MAX_DRAIN messages and MAX_DRAIN_S; returns how many were handled."""
        pool = self.pool
        until_s = time.monotonic() + MAX_DRAIN_S
        handled = 0
        for _ in range(MAX_DRAIN):
            try:
                frames = sockets.recv_frames(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled += 1
            identity = frames[0].bytes
            now_s = time.monotonic()
            last = now_s >= until_s  # this one is handled; the rest wait for the next pass (after the sends)
            user_id = _user_id(frames[1]) if self.security is not None and len(frames) > 1 else None
            role = role_of(frames[1]) if user_id else None
            started = time.perf_counter()
            try:
                pool.handle(identity, frames[1:], now_s, authenticated_role=role, authenticated_key=user_id)
                pool.loop_times.step(pool.handled_kind, time.perf_counter() - started)
            except HalfApplied:  # a bug after the state began to change: end the process (loraflow.broker.dispatch)
                log.exception("handler_failed_applying", peer=display_name(identity)[:64])
                raise
            except Exception:  # a bug in a validation costs one message, not the broker: nothing was changed
                log.exception("handler_failed", peer=display_name(identity)[:64])
                pool.internal_error(identity, frames[1:])
            if last:
                return handled
        return handled

    def _count_refused_handshakes(self) -> None:
        """CURVE handshakes the ZAP thread refused (unknown keys) since the last pass, into ``auth{refused}``."""
        if self.security is None:
            return
        refused = self.security.num_refused
        if refused != self._refused_counted:
            self.pool.stats.count("auth", "refused", refused - self._refused_counted)
            self._refused_counted = refused

    def _send_all(self, outgoing: list) -> None:
        for out in outgoing:
            try:
                sockets.send_frames(self.sock, [out.identity, *out.frames], zmq.NOBLOCK)
            except zmq.Again:
                self.pool.send_failed(out, "hwm")
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self.pool.send_failed(out, "unreachable")

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            name = MONITOR_EVENTS.get(event["event"])
            if name:
                self.pool.stats.count("connections", name)
            elif event["event"] & HANDSHAKE_FAILURES:
                self._handshake_failed(event["event"], event["value"])

    def _handshake_failed(self, event: int, value: int) -> None:
        """Count a failed handshake by cause; log each cause at most every HANDSHAKE_LOG_INTERVAL_S."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            cause, why = "wrong_server_key", ("a CURVE client whose broker public key is not this broker's "
                                              "(give it this keys dir's broker.key)")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            cause, why = (("plaintext", "a client without CURVE (security.enabled = false there)")
                          if self.security is not None else
                          ("curve_client", "a CURVE client, but security is off here (security.enabled)"))
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            cause, why = "dropped", (f"the client hung up during the handshake (errno {value}): most often a client "
                                     "without CURVE that noticed the mismatch first, as libzmq reports it then")
        else:
            cause, why = "handshake_failed", f"zmq handshake error {value:#x}"
        self.pool.stats.count("auth", cause)
        total = self.pool.stats.get("auth", cause)
        now_s = time.monotonic()
        last_s, logged = self._handshake_logged.get(cause, (-HANDSHAKE_LOG_INTERVAL_S, 0))
        if now_s - last_s >= HANDSHAKE_LOG_INTERVAL_S:
            log.warning("handshake_failed", cause=cause, why=why, num_since_last_log=total - logged)
            self._handshake_logged[cause] = (now_s, total)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=sockets.LINGER_MS)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.security is not None:
            self.security.stop()
