"""Rank 0's conversation with the broker: batch long-polls, batch acks, adapter publishing, broker restarts.

    learner rank 0                                                    broker
    want_batch(); poll()  BatchRequest(num_groups, wait_ms, version) ->
                        <- Batch                                       (empty after wait_ms: asked again)
    publish(snapshot)     AdapterUpdate(version) + LoRA tensors        ->
                        <- AdapterAck(version)                         (time from send to here is recorded)
    ack_batch(ack)        BatchAck(batch_id, step, group ids, ...)     ->
                        <- BatchSettled(batch_id)                      (kept until then)
    Reconnected (a new broker process, or the same one after a cut link):  re-send every unacknowledged BatchAck,
                                         the outstanding BatchRequest, and the newest adapter unless the broker
                                         holds it (the same broker at that version) or knows a newer version.

Nothing here blocks except :meth:`BrokerSession.poll` (up to its timeout) and :meth:`BrokerSession.drain`;
heartbeats run in the BrokerLink's I/O thread, so a long training step never looks like a dead learner.
Errors from the broker are logged and counted (``broker_errors{code}``). Two are fatal: a BatchRequest refused
with ``limit`` (the broker can never hold that many groups) raises :class:`BatchRequestRefused`, and
``replaced`` (another learner process connected to the broker and took over the run; this one is fenced)
raises :class:`LearnerReplaced`.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import (
    AdapterAck,
    Batch,
    BatchAck,
    BatchRequest,
    BatchSettled,
    Error,
    Hello,
    Kind,
    Welcome,
)
from loraflow.common.transport import BrokerLink, BrokerUnavailable, Incoming, Reconnected
from loraflow.learner.publish import AdapterSnapshot

log = get_logger("learner.session")


class BatchRequestRefused(RuntimeError):
    """The broker can never serve the batch size asked for (run.groups_per_step vs broker.capacity_groups)."""


class LearnerReplaced(RuntimeError):
    """The broker fenced this learner: another learner process took over the run."""


@dataclass(slots=True)
class AdapterAckTime:
    version: int
    seconds: float  # from sending the AdapterUpdate to its Ack's arrival: stored and on the broker's disk
    # (workers are told of it when it is stored, before the write)


class BrokerSession:
    """The learner's single connection to the broker (rank 0 only)."""

    def __init__(self, config: Config, *, version: int, metrics: Metrics, client_id: str = "learner") -> None:
        from loraflow.common.security import client_security

        broker = config.broker
        self._config = config
        hello = Hello(role="learner", client_id=client_id, run=config.run.pool_run, adapter_version=version)
        self.link = BrokerLink(broker.endpoint, hello, security=client_security(config, role="learner"),
                               heartbeat_interval_s=broker.heartbeat_interval_s,
                               heartbeat_timeout_s=broker.heartbeat_interval_s * broker.heartbeat_misses,
                               max_message_bytes=broker.max_message_bytes)
        self.metrics = metrics
        self.welcome: Welcome | None = None
        self._wanted: BatchRequest | None = None
        self._outstanding = False
        self._unacked_batches: dict[str, BatchAck] = {}
        self._surplus: collections.deque[Incoming] = collections.deque()  # batches that came unasked
        self._newest: AdapterSnapshot | None = None
        self._adapter_sent_at: dict[int, float] = {}
        self.adapter_acks: list[AdapterAckTime] = []  # taken by the loop for its metrics

    def start(self, timeout_s: float) -> Welcome:
        deadline = time.monotonic() + timeout_s
        # a pool run's learner proves its run with the run's token under CURVE too (a key is a role, not a run);
        # read now, not at construction: a broker started at the same time
        if not self._config.security.enabled or self._config.run.pool_run:
            from loraflow.common.run_token import (  # as this learner has written it by then
                learner_token,
                token_path,
            )

            token = learner_token(self._config)
            if not token:  # a broker not started yet writes it on its first start: any start order works
                log.info("run_token_wait", path=str(token_path(self._config)), timeout_s=timeout_s,
                         fix="on another host set security.run_token (the same on both) or copy the file")
            while not token and time.monotonic() < deadline:
                time.sleep(0.1)
                token = learner_token(self._config)
            if not token:
                raise BrokerUnavailable(f"no run token at {token_path(self._config)} within {timeout_s:.0f} s "
                                        "(run.connect_timeout_s): the broker writes it on its first start with this "
                                        "run directory; is it running? On another host set security.run_token (the "
                                        "same on both) or security.run_token_file to a copy")
            self.link.hello.token = token
        self.welcome = self.link.start(max(1.0, deadline - time.monotonic()))
        return self.welcome

    @property
    def latest_version(self) -> int:
        """The newest adapter version the broker has announced (welcome, heartbeat pongs)."""
        return self.link.latest_version

    # -- batches ---------------------------------------------------------------------------------------------

    def want_batch(self, num_groups: int, wait_ms: int, version: int) -> None:
        """Ask for the next batch (a long-poll; re-asked after each empty answer until one arrives)."""
        self._wanted = BatchRequest(num_groups=num_groups, wait_ms=wait_ms, learner_version=version)
        if not self._outstanding:
            self._send_request()

    def _send_request(self) -> None:
        assert self._wanted is not None
        self.link.send(self._wanted)
        self._outstanding = True

    def poll(self, timeout_s: float) -> Incoming | None:
        """The next non-empty Batch, or None after ``timeout_s``; handles acks, errors and reconnects meanwhile."""
        if self._wanted is not None and not self._outstanding:
            self._send_request()
        if self._surplus and self._wanted is not None:
            self._wanted = None
            return self._surplus.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            item = self.link.recv(max(0.0, deadline - time.monotonic()))
            if item is None:
                return None
            batch = self._handle(item)
            if batch is not None:
                return batch

    def _handle(self, item: Incoming | Reconnected) -> Incoming | None:
        if isinstance(item, Reconnected):
            self._on_reconnected(item.welcome)
            return None
        record = item.record
        if isinstance(record, Batch):
            self._outstanding = False
            if record.groups:
                if self._wanted is None:  # e.g. a request re-sent after a reconnect was answered twice
                    self._surplus.append(item)
                    return None
                self._wanted = None
                return item
            if self._wanted is not None:  # the long-poll ran out: ask again
                self._send_request()
            return None
        if isinstance(record, AdapterAck):
            sent_at = self._adapter_sent_at.pop(record.version, None)
            if sent_at is not None:
                # when it arrived, not when this loop got to read it (after a whole step, at times)
                self.adapter_acks.append(AdapterAckTime(record.version, item.received_at - sent_at))
        elif isinstance(record, BatchSettled):
            self._unacked_batches.pop(record.batch_id, None)
        elif isinstance(record, Error):
            self._on_error(record)
        else:
            log.warning("unexpected_message", kind=type(record).__name__)
        return None

    def ack_batch(self, ack: BatchAck) -> None:
        """Tell the broker a batch was trained; kept and re-sent after a broker restart until acknowledged."""
        self._unacked_batches[ack.batch_id] = ack
        self.link.send(ack)

    @property
    def num_unacked(self) -> int:
        return len(self._unacked_batches) + len(self._adapter_sent_at)

    # -- adapters --------------------------------------------------------------------------------------------

    def publish(self, snap: AdapterSnapshot) -> None:
        """Send an adapter version (does not wait for the broker's Ack; see ``adapter_acks``)."""
        self._newest = snap
        self.link.hello.adapter_version = snap.version  # what a hello after a broker restart says
        self._adapter_sent_at[snap.version] = time.monotonic()
        self.link.send(snap.update(), snap.tensors)

    # -- replies ---------------------------------------------------------------------------------------------

    def _on_error(self, error: Error) -> None:
        self.metrics.inc("broker_errors", code=error.code)
        log.warning("broker_error", code=error.code, message=error.message, ref_kind=error.ref_kind,
                    ref_id=error.ref_id)
        if error.code == "replaced":
            raise LearnerReplaced(error.message)
        if error.ref_kind == Kind.BATCH_REQUEST:
            if error.code == "limit":  # the broker can never hold that many groups: waiting will not help
                raise BatchRequestRefused(f"{error.message}; make run.groups_per_step the same for the broker and "
                                          "the learner, or raise broker.capacity_groups")
            self._outstanding = False  # asked again at the next poll
        elif error.ref_kind == Kind.ADAPTER_UPDATE and error.ref_version:
            # e.g. stale_version: the broker knows a newer version; the next one is numbered after it
            self._adapter_sent_at.pop(error.ref_version, None)
        elif error.ref_kind == Kind.BATCH_ACK:
            self._unacked_batches.pop(error.ref_id, None)

    def _on_reconnected(self, welcome: Welcome) -> None:
        same_broker = self.welcome is not None and self.welcome.broker_id == welcome.broker_id
        self.welcome = welcome
        self.metrics.inc("broker_reconnects")
        log.info("broker_reconnected", broker_id=welcome.broker_id, latest_version=welcome.latest_version,
                 unacked_batches=len(self._unacked_batches))
        for ack in self._unacked_batches.values():
            self.link.send(ack)
        # a restarted broker may know our newest version (persisted) but not its tensors: send them again (the same
        # broker welcoming us back after a cut link holds them, unless our newest was lost on the way)
        newest_missing = self._newest is not None and (welcome.latest_version < self._newest.version or (
            welcome.latest_version == self._newest.version and not same_broker))
        if newest_missing:
            self._adapter_sent_at[self._newest.version] = time.monotonic()
            self.link.send(self._newest.update(), self._newest.tensors)
        if self._wanted is not None:
            self._send_request()

    def drain(self, timeout_s: float) -> bool:
        """Wait (bounded) until the broker acknowledged every batch ack and adapter; True if it did."""
        deadline = time.monotonic() + timeout_s
        while self.num_unacked and time.monotonic() < deadline:
            item = self.link.recv(max(0.0, deadline - time.monotonic()))
            if item is not None:
                self._handle(item)
        return not self.num_unacked

    def close(self, reason: str = "") -> None:
        self.link.close(reason)
