"""The live picture a Stats reply carries, read off the broker core's parts (:class:`BrokerParts`).

``loraflow status`` (deploy/status.py) renders it; tests assert on it. Top-level keys:

    broker_id, uptime_s, latest_version, vocab_size, settings{...}
    prompts{epoch, index, queued, leased, buffered, training, trained_total, exhausted}
    buffer{groups, bytes, training_groups, training_bytes, max_groups, max_bytes, memory_bytes (what counts
           against max_bytes: frames + per-group overhead), staleness{str: n}, oldest_age_s, mean_group_bytes}
    credit                 groups that may still be leased now (capacity, admission limit, byte bound)
    leases{outstanding, list[...]}, waiting{lease_requests, batch_requests}
    workers[{id, state, adapter_version, leases, last_seen_s, groups_accepted, busy_share, counters,
             integrity (ok, quarantined, probation), ...}]
                           at most MAX_WORKERS_LISTED rows (the longest registered); num_workers counts them all
    learner{id, state, ..., step, trained_version, checkpoint_version, busy_share} | None
    learner_busy_share     from the learner's counters (busy_s / (busy_s + idle_s)) when it reports them,
                           else from the states its heartbeats reported
    adapters[{version, num_bytes, ...}]
    history{uncommitted_groups, withdrawn[[lo, hi]], learner_session}   (see loraflow.broker.history)
    integrity{quarantine_after, quarantine_window, policy_mismatches{reason: n}, events{quarantined, probation,
              cleared}, num_quarantined, num_probation, quarantined[...], probation[...]}   (loraflow.broker.quarantine)
              at most MAX_FLAGGED_LISTED rows each
              {worker, session, status, since_s, num_failed, num_checked (of its last window), num_quarantines,
               evidence[{group_id, reason, version, num_checked, num_off, max_abs_diff, mean_abs_diff, detail,
               age_s, when_unix}]}
    counters as in loraflow.broker.stats: messages_in/out, bytes_in/out, rejected, num_rejected, dropped, send_failed,
    group_events, lease_events, served_staleness, adapter_events, peers_gone, connections, auth, state_writes,
    rates{...}

Every dict key is a string (msgpack maps decode with string keys only). The reply is bounded whatever the
fleet sends: at most MAX_WORKERS_LISTED worker rows and MAX_LEASES_LISTED leases, and each row's counters are
at most 64 numbers (``Heartbeat.counters``, checked at decode), so a Stats reply stays under ~2 MB for anyone
who asks (a StatsRequest needs no Hello). :class:`StatsReply` owns the encoded reply of the latest state.
"""

from __future__ import annotations

from typing import Any, Protocol

from loraflow.broker.adapters import AdapterRelay
from loraflow.broker.batching import BatchDesk
from loraflow.broker.history import RunProgress, TrainingHistory
from loraflow.broker.leasing import LeaseDesk
from loraflow.broker.ledger import GroupLedger
from loraflow.broker.peers import Peer, PeerRegistry
from loraflow.broker.quarantine import Quarantine, Status
from loraflow.broker.stats import BrokerStats, LoopTimes
from loraflow.common import codec, protocol
from loraflow.common.config import Config

MAX_LEASES_LISTED = 200
MAX_WORKERS_LISTED = 256
MAX_FLAGGED_LISTED = 64  # quarantined (and probation) worker processes listed, each with up to 4 evidence records


class BrokerParts(Protocol):
    """The parts a snapshot is read off (:class:`loraflow.broker.core.BrokerCore` has each of them)."""

    config: Config
    broker_id: str
    vocab_size: int
    capacity_groups: int
    started_s: float  # the core's start on its monotonic clock ...
    started_unix: float  # ... and on the wall clock
    ledger: GroupLedger
    peers: PeerRegistry
    progress: RunProgress
    history: TrainingHistory
    quarantine: Quarantine
    leasing: LeaseDesk
    batching: BatchDesk
    relay: AdapterRelay
    loop_times: LoopTimes
    stats: BrokerStats


def _busy_share_from_counters(counters: dict[str, Any]) -> float | None:
    busy = counters.get("busy_s")
    idle = counters.get("idle_s", counters.get("wait_s"))
    if not isinstance(busy, int | float) or not isinstance(idle, int | float) or busy + idle <= 0:
        return None
    return round(busy / (busy + idle), 4)


def _peer_row(parts: BrokerParts, peer: Peer, now_s: float) -> dict[str, Any]:
    share = peer.busy_share(now_s)
    integrity = {"integrity": str(parts.quarantine.status((peer.client_id, peer.session)))} if peer.role == "worker" \
        else {}
    return {
        "id": peer.client_id, "identity": peer.name, "role": peer.role, "state": peer.state,
        "adapter_version": peer.adapter_version, "leases": parts.ledger.leases.count(peer.identity),
        "capacity": peer.capacity, "backend": peer.backend, "host": peer.host, "pid": peer.pid,
        "session": peer.session, "last_seen_s": round(now_s - peer.last_seen_s, 3),
        "uptime_s": round(now_s - peer.registered_s, 1), "groups_accepted": peer.num_groups_accepted,
        "groups_rejected": peer.num_groups_rejected, "leases_granted": peer.num_leases_granted,
        "busy_share": None if share is None else round(share, 4), "counters": peer.counters,
        **integrity,
    }


def _integrity(parts: BrokerParts, now_s: float) -> dict[str, Any]:
    integrity = parts.config.integrity
    now_unix = parts.started_unix + (now_s - parts.started_s)
    return {"quarantine_after": integrity.quarantine_after, "quarantine_window": integrity.quarantine_window,
            "policy_mismatches": parts.stats.family("policy_mismatches"),
            "events": parts.stats.family("quarantines"),
            **parts.quarantine.snapshot(now_s, now_unix, limit=MAX_FLAGGED_LISTED)}


def build_snapshot(parts: BrokerParts, now_s: float) -> dict[str, Any]:
    ledger = parts.ledger
    buffer = ledger.buffer
    buffered = buffer.buffered()
    all_workers = parts.peers.of_role("worker")
    workers = [_peer_row(parts, p, now_s) for p in all_workers[:MAX_WORKERS_LISTED]]
    learners = parts.peers.of_role("learner")
    learner = None
    learner_share = None
    if learners:
        learner = {**_peer_row(parts, learners[0], now_s), **parts.progress.learner,
                   "batches_in_flight": len(buffer.batch_ids())}
        learner_share = _busy_share_from_counters(learners[0].counters)
        if learner_share is None:
            learner_share = learner["busy_share"]
    credit = parts.leasing.credit()
    broker = parts.config.broker
    return {
        "broker_id": parts.broker_id,
        "uptime_s": round(now_s - parts.started_s, 3),
        "latest_version": parts.progress.latest_version,
        "vocab_size": parts.vocab_size,
        "settings": {
            "task": parts.config.run.task, "group_size": parts.config.run.group_size,
            "groups_per_step": parts.config.run.groups_per_step, "max_staleness": parts.config.run.max_staleness,
            "capacity_groups": parts.capacity_groups, "max_buffer_bytes": broker.max_buffer_bytes,
            "lease_timeout_s": broker.lease_timeout_s, "heartbeat_interval_s": broker.heartbeat_interval_s,
            "heartbeat_misses": broker.heartbeat_misses, "max_heartbeats_per_second": broker.max_heartbeats_per_second,
            "heartbeat_interval_asked_s": parts.peers.interval_s, "heartbeat_timeout_s": parts.peers.timeout_s,
        },
        "prompts": {**ledger.snapshot(), "trained_total": parts.progress.num_trained_total,
                    "exhausted": ledger.source.exhausted()},
        "buffer": {
            "groups": buffer.num_buffered, "bytes": buffer.buffered_bytes,
            "training_groups": buffer.num_training, "training_bytes": buffer.training_bytes,
            "max_groups": buffer.max_groups, "max_bytes": buffer.max_bytes,
            "memory_bytes": buffer.memory_bytes,
            "staleness": {str(k): v for k, v in buffer.staleness_histogram(parts.progress.latest_version).items()},
            "oldest_age_s": round(now_s - buffered[0].received_s, 3) if buffered else 0.0,
            "mean_group_bytes": round(parts.progress.mean_group_bytes, 1),
        },
        "credit": credit,
        "leases": {"outstanding": ledger.num_leased,
                   "list": ledger.leases.snapshot(now_s)[:MAX_LEASES_LISTED]},
        "waiting": {"lease_requests": len(parts.leasing.waiters), "batch_requests": len(parts.batching.waiters)},
        "workers": workers,
        "num_workers": len(all_workers),
        "learner": learner,
        "learner_busy_share": learner_share,
        "adapters": parts.relay.adapters.snapshot(),
        "history": parts.history.snapshot(),
        "integrity": _integrity(parts, now_s),
        "loop": parts.loop_times.snapshot(),
        **parts.stats.snapshot(now_s),
    }


class StatsReply:
    """The encoded Stats reply, built once per state change: StatsRequests in between (a burst of them, from
    anyone: no Hello needed) share it, so neither their CPU nor their unread replies grow with their number."""

    def __init__(self) -> None:
        self._cached: tuple[int, list[Any]] | None = None  # (the core's change count, frames)

    def frames(self, parts: BrokerParts, num_changes: int, now_s: float) -> list[Any]:
        if self._cached is None or self._cached[0] != num_changes:
            self._cached = (num_changes, codec.encode(protocol.Stats(snapshot=build_snapshot(parts, now_s))))
        return self._cached[1]


def set_gauges(parts: BrokerParts) -> None:
    """The Prometheus gauges (``loraflow_broker_<name>``), set once per stats tick."""
    ledger = parts.ledger
    buffer = ledger.buffer
    for name, value in (("latest_version", parts.progress.latest_version), ("buffer_groups", buffer.num_buffered),
                        ("buffer_bytes", buffer.buffered_bytes), ("training_groups", buffer.num_training),
                        ("training_bytes", buffer.training_bytes), ("leases_outstanding", ledger.num_leased),
                        ("workers", parts.peers.num_workers()), ("prompts_queued", ledger.num_queued),
                        ("heartbeat_interval_s", parts.peers.interval_s),
                        ("lease_waiters", len(parts.leasing.waiters)), ("batch_waiters", len(parts.batching.waiters)),
                        ("quarantined_workers", parts.quarantine.count(Status.QUARANTINED)),
                        ("probation_workers", parts.quarantine.count(Status.PROBATION))):
        parts.stats.metrics.set(name, value)
