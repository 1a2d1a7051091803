"""The worker's session with the broker: leases, submissions kept until acknowledged, adapter fetches.

:class:`BrokerSession` sits on a :class:`loraflow.common.transport.BrokerLink` (hello, heartbeats, reconnects in its I/O
thread) and adds a dispatcher thread that handles everything the broker sends, so that acks and adapters are
processed while the worker loop is busy generating::

    LeaseGrant      -> grants queue (the worker loop starts the groups); reason stale_adapter -> fetch newest
    GroupAck        -> drop the kept copy of that group (accepted or duplicate; one GroupAck may name several)
    Error(invalid_group, group id) -> drop it too (the broker re-queued the prompt), counted
    AdapterNotice   -> remember the newest version published; fetch it when the next adapter is wanted
    AdapterUpdate   -> verify + write (AdapterStore) -> the adapter slot (the loop takes it between chunks)
    Reconnected     -> re-send every group not yet acknowledged; the pending lease request is void

Adapters: the worker only ever loads the newest version it knows of, so the session never fetches, verifies or
writes one it would skip. It keeps at most one adapter ahead of the backend: one :class:`ReceivedAdapter` in a
slot (verified and written, waiting for the worker loop's :meth:`take_adapter`) or one AdapterFetch in flight,
never both. Notices only raise the newest version known; a fetch (always "the newest", ``AdapterFetch(0)``)
goes out when that is above what was received, nothing waits in the slot and no fetch is in flight (or it was
sent ``FETCH_RETRY_S`` ago): on a notice, and when the loop takes the slot (so the next version is fetched while
the current one loads). A learner publishing faster than a worker loads therefore costs one fetch per load,
not one per version; the versions published in between are never transferred. An update that arrives no
newer than one already received (an answer to an older fetch, a broker's push after a reconnect) is dropped
before any check or write; one that is newer than the adapter in the slot replaces it (the older directory is
deleted). Both count as ``adapters_superseded``. The answer to a fetch is used even when a newer notice
overtook it in flight: it is the broker's newest of one round trip ago, and skipping it would starve a worker
whose learner publishes more often than one round trip. The Welcome counts as a notice: a broker ahead of the
hello's version also sends an AdapterNotice after it, and the tensors come only with a fetch.

Delivery: :meth:`submit` keeps each group's encoded frames until the broker acknowledges its group id, and
re-sends them all after a broker restart; the broker deduplicates by group id, so at-least-once is safe. A group
over the broker's ``max_message_bytes`` is never sent: its lease goes back (counted ``groups_rejected{oversize}``,
logged with what to change). The
``wake`` event is set whenever something arrives that the worker loop should act on.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog

from loraflow.common import codec, protocol
from loraflow.common.config import Config
from loraflow.common.logging import bind, get_logger
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import (
    AdapterFetch,
    AdapterNotice,
    AdapterUpdate,
    Error,
    Hello,
    Kind,
    LeaseGrant,
    LeaseRequest,
    LeaseReturn,
    Welcome,
)
from loraflow.common.transport import BrokerLink, Incoming, MessageTooLarge, Reconnected
from loraflow.rollout_worker.adapters import AdapterRejected, AdapterStore, ReceivedAdapter
from loraflow.rollout_worker.samples import FinishedGroup

log = get_logger("client")

LEASE_WAIT_MS = 1000
FETCH_RETRY_S = 5.0


@dataclass(slots=True)
class PendingGroup:
    group_id: str
    frames: list[Any]
    first_sent: float
    num_sends: int = 1


class BrokerSession:
    """Leases, submissions and adapters over one BrokerLink (see the module docstring)."""

    def __init__(self, config: Config, *, worker_id: str, store: AdapterStore, metrics: Metrics,
                 wake: threading.Event, security: Any = None) -> None:
        broker = config.broker
        hello = Hello(role="worker", client_id=worker_id, run=config.run.pool_run, backend=config.worker.backend,
                      capacity=config.worker.capacity, batched_acks=True)
        self.link = BrokerLink(broker.endpoint, hello, security=security,
                               heartbeat_interval_s=broker.heartbeat_interval_s,
                               heartbeat_timeout_s=broker.heartbeat_interval_s * broker.heartbeat_misses,
                               max_message_bytes=broker.max_message_bytes)
        self.worker_id = worker_id
        # a lease request unanswered this long after its wait_ms is taken as lost (the broker went away)
        self._answer_grace_s = 2 * broker.heartbeat_interval_s * broker.heartbeat_misses
        self.store = store
        self.metrics = metrics
        self.wake = wake
        self.grants: queue.Queue[LeaseGrant] = queue.Queue()
        self.welcome: Welcome | None = None
        self._lock = threading.Lock()
        self._unacked: dict[str, PendingGroup] = {}
        self._lease_request_deadline: float | None = None  # monotonic; None = no request outstanding
        # adapters (see the module docstring); the version the backend serves is the backend's, told via
        # set_adapter_version for the wire (hello, heartbeats) only
        self._newest_published = 0  # the newest version the broker said exists (Welcome, notices, grants)
        self._newest_received = 0  # the newest version verified and written (in the slot, loading or loaded)
        self._slot: ReceivedAdapter | None = None  # verified, not yet taken by the worker loop
        self._fetch: tuple[int, float] | None = None  # (version wanted, sent at) of the adapter fetch in flight
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> Welcome:
        self.welcome = self.link.start(timeout_s)
        self._welcomed(self.welcome)
        self._thread = threading.Thread(target=self._dispatch, args=(structlog.contextvars.get_contextvars(),),
                                        name="broker-session", daemon=True)
        self._thread.start()
        log.info("joined", endpoint=self.link.endpoint, latest_version=self.welcome.latest_version,
                 group_size=self.welcome.group_size, max_staleness=self.welcome.max_staleness)
        return self.welcome

    def close(self, reason: str = "") -> None:
        """Stop the dispatcher, say Bye and close the link."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            # not alive: never started, or a signal interrupted Thread.start() (the worker's start-up stop), so
            # the thread may be only starting; its loop checks the stop flag first and leaves
            self._thread.join(timeout=5)
        self.link.close(reason=reason, send_bye=self.welcome is not None)  # no Bye to a broker never reached

    # -- requests from the worker loop -------------------------------------------------------------------------

    @property
    def lease_request_pending(self) -> bool:
        with self._lock:
            if self._lease_request_deadline is not None and time.monotonic() > self._lease_request_deadline:
                self._lease_request_deadline = None  # lost (broker gone or restarted): ask again
            return self._lease_request_deadline is not None

    def request_leases(self, max_leases: int, adapter_version: int, wait_ms: int = LEASE_WAIT_MS) -> None:
        """Long-poll for up to ``max_leases`` leases; the grant arrives on :attr:`grants`."""
        with self._lock:
            self._lease_request_deadline = time.monotonic() + wait_ms / 1000 + self._answer_grace_s
        self.link.send(LeaseRequest(max_leases=max_leases, adapter_version=adapter_version, wait_ms=wait_ms))

    def return_leases(self, lease_ids: list[str], reason: str) -> None:
        if lease_ids:
            self.link.send(LeaseReturn(lease_ids=lease_ids, reason=reason[:256]))
            self.metrics.inc("leases_returned", len(lease_ids), reason=reason)

    def submit(self, finished: FinishedGroup) -> None:
        """Send a group and keep it until the broker acknowledges it. A group larger than the broker accepts
        is dropped, its lease returned (the prompt is generated again) and the reason logged and counted."""
        frames = codec.encode(finished.group, finished.tensors)
        group_id = finished.group.group_id
        with self._lock:
            self._unacked[group_id] = PendingGroup(group_id, frames, time.monotonic())
        try:
            self.link.send_frames(list(frames))
        except MessageTooLarge as exc:
            with self._lock:
                self._unacked.pop(group_id, None)
            self.metrics.inc("groups_rejected", reason="oversize")
            log.error("group_too_large", group_id=group_id, error=str(exc),
                      fix="lower worker.max_new_tokens / run.group_size, or raise broker.max_message_bytes")
            self.return_leases([finished.group.lease_id], "group too large")
            return
        self.metrics.inc("groups_submitted")

    @property
    def num_unacked(self) -> int:
        with self._lock:
            return len(self._unacked)

    def set_adapter_version(self, version: int) -> None:
        """The version the backend now serves: reported in heartbeats and in any later hello."""
        self.link.hello.adapter_version = version
        self.link.set_state(adapter_version=version)

    def take_adapter(self) -> ReceivedAdapter | None:
        """The adapter waiting in the slot (the newest received), if any; the next newer one is fetched now."""
        with self._lock:
            adapter, self._slot = self._slot, None
        if adapter is not None:
            self._fetch_if_wanted()
        return adapter

    def discard_adapter(self, adapter: ReceivedAdapter) -> None:
        """Delete the files of an adapter the backend could not load."""
        self.store.discard(adapter.version)

    def _published(self, version: int) -> None:
        """The broker says ``version`` exists (a notice, a grant, a Welcome)."""
        with self._lock:
            self._newest_published = max(self._newest_published, version)
        self._fetch_if_wanted()

    def _fetch_if_wanted(self, *, force: bool = False) -> None:
        """Send AdapterFetch(newest) when a newer version exists (or ``force``: the broker says ours is stale),
        the slot is empty and no fetch is in flight (see the module docstring)."""
        with self._lock:
            now = time.monotonic()
            wanted = max(self._newest_published, self._newest_received + 1 if force else 0)
            if (wanted <= self._newest_received or self._slot is not None
                    or (self._fetch is not None and now - self._fetch[1] < FETCH_RETRY_S)):
                return
            self._fetch = (wanted, now)
        self.metrics.inc("adapter_fetches")
        self.link.send(AdapterFetch(version=0))

    def _welcomed(self, welcome: Welcome) -> None:
        """The Welcome says which version is the newest: fetch it when ahead of ours (the broker sends only a
        notice after the Welcome, never the tensors unasked)."""
        with self._lock:
            self._newest_published = max(self._newest_published, welcome.latest_version)
        if welcome.latest_version > self.link.hello.adapter_version:
            self._fetch_if_wanted()

    # -- dispatcher thread -------------------------------------------------------------------------------------

    def _dispatch(self, context: dict[str, Any]) -> None:
        bind(**context)  # threads do not inherit the log context (worker id) of the thread that started them
        while not self._stop.is_set():
            item = self.link.recv(timeout_s=0.1)
            if item is None:
                continue
            try:
                if isinstance(item, Reconnected):
                    self._on_reconnected(item)
                else:
                    self._on_message(item)
            except Exception as exc:  # a bad message must not kill the session; count it and go on
                self.metrics.inc("client_errors", kind=type(exc).__name__)
                log.exception("dispatch_failed", error=str(exc))

    def _on_message(self, item: Incoming) -> None:
        record = item.record
        if isinstance(record, LeaseGrant):
            with self._lock:
                self._lease_request_deadline = None
            if record.reason == "stale_adapter":  # the broker wants a newer adapter before it leases
                with self._lock:
                    self._newest_published = max(self._newest_published, record.latest_version)
                self._fetch_if_wanted(force=True)
            self.grants.put(record)
            self.wake.set()
        elif isinstance(record, protocol.GroupAck):
            for group_id in record.ids:  # one GroupAck may cover several groups (Hello.batched_acks)
                with self._lock:  # logged before the count drops: the worker's "stopped" line comes after it
                    pending = self._unacked.get(group_id)
                    if pending is None:
                        continue
                    self.metrics.inc("groups_acked", status=record.status)
                    log.info("group_acked", group_id=group_id, status=record.status,
                             rtt_ms=round((time.monotonic() - pending.first_sent) * 1000, 1),
                             sends=pending.num_sends)
                    del self._unacked[group_id]
                self.wake.set()
        elif isinstance(record, AdapterNotice):
            self._published(record.version)
        elif isinstance(record, AdapterUpdate):
            self._on_adapter(record, item)
        elif isinstance(record, Error):
            self._on_error(record)
        else:
            self.metrics.inc("unexpected_messages", kind=type(record).__name__)
            log.warning("unexpected_message", kind=type(record).__name__)

    def _on_adapter(self, update: AdapterUpdate, item: Incoming) -> None:
        with self._lock:
            self._fetch = None  # the answer (the broker answers one fetch with one update)
            self._newest_published = max(self._newest_published, update.version)
            superseded = update.version <= self._newest_received
        if superseded:  # an answer to an older fetch, or a push after a reconnect: never checked or written
            self.metrics.inc("adapters_superseded")
            self._fetch_if_wanted()
            return
        try:
            adapter = self.store.receive(update, item.envelope.specs, item.envelope.frames)
        except AdapterRejected as exc:
            self.metrics.inc("adapters_rejected", reason=exc.reason)
            log.warning("adapter_rejected", version=update.version, reason=exc.reason, error=str(exc))
            return
        with self._lock:
            replaced, self._slot = self._slot, adapter
            self._newest_received = adapter.version
        if replaced is not None:  # only when an unasked push raced a fetch: the older one is never loaded
            self.metrics.inc("adapters_superseded")
            self.discard_adapter(replaced)
        self.metrics.inc("adapters_received")
        self.metrics.inc("adapter_bytes_received", adapter.num_bytes)
        self.wake.set()

    def _on_error(self, error: Error) -> None:
        self.metrics.inc("broker_errors", code=error.code)
        if error.ref_kind == Kind.ROLLOUT_GROUP and error.ref_id:
            with self._lock:
                dropped = self._unacked.pop(error.ref_id, None)
            if dropped is not None:
                self.metrics.inc("groups_rejected", reason=error.code)
        elif error.ref_kind == Kind.LEASE_REQUEST:
            with self._lock:
                self._lease_request_deadline = None
            self.wake.set()
        elif error.ref_kind == Kind.ADAPTER_FETCH:  # nothing kept at the broker: the next notice fetches again
            with self._lock:
                self._fetch = None
        log.warning("broker_error", code=error.code, message=error.message, ref_kind=error.ref_kind,
                    ref_id=error.ref_id)

    def _on_reconnected(self, event: Reconnected) -> None:
        self.welcome = event.welcome
        with self._lock:
            self._lease_request_deadline = None
            self._fetch = None
        self._welcomed(event.welcome)
        with self._lock:
            pending = list(self._unacked.values())
            for group in pending:
                group.num_sends += 1
        for group in pending:
            try:
                self.link.send_frames(list(group.frames))
            except MessageTooLarge as exc:  # the new broker allows less: its prompt is queued there already
                with self._lock:
                    self._unacked.pop(group.group_id, None)
                self.metrics.inc("groups_rejected", reason="oversize")
                log.error("group_too_large", group_id=group.group_id, error=str(exc))
        self.metrics.inc("groups_resent", len(pending))
        log.info("broker_reconnected", broker_id=event.welcome.broker_id, resent=len(pending),
                 latest_version=event.welcome.latest_version)
        self.wake.set()
