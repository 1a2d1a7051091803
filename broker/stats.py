"""The broker's counters, rates and histograms, and how they reach a Stats reply and Prometheus.

Hot-path accounting is plain ``Counter`` increments (a few per message); once per tick (about a second) the
deltas are pushed into :class:`loraflow.common.metrics.Metrics`, which serves Prometheus ``/metrics``, and a sample
of the totals is kept so rates can be given over the last ``window_s`` seconds.

Every message that is refused, every group that is dropped and every send that fails lands in a counter with
a reason, so the counters account for every message: ``messages_in`` (by kind) = handled + ``rejected``.

Counter families (Prometheus name ``loraflow_broker_<family>_total{label=...}``):

    messages_in{kind} / messages_out{kind}   bytes_in / bytes_out
    rejected{reason}      a message refused with an Error reply (or none, where no reply is possible)
    dropped{reason}       a group removed without training: stale, stale_on_arrival, buffer_full, not_trained,
                          withdrawn / withdrawn_on_arrival (holds tokens of a version a restarted learner
                          rolled back), policy_mismatch (failed the learner's policy check, or buffered from a
                          worker process that was then quarantined)
    send_failed{reason}   a reply zmq would not take: unreachable (peer gone), hwm (peer's queue full)
    groups{event}         accepted, duplicate, served, trained, restored (learner gone, back to the buffer),
                          rolled_back (trained after the checkpoint a restarted learner resumed from: re-queued)
    leases{event}         granted, submitted, returned, expired, reclaimed, cancelled, undeliverable, renewed,
                          quarantined (held by a process when it was quarantined: re-queued)
    served_staleness{staleness}
    adapters{event}       published, restored (re-published after a broker restart), withdrawn
    peers_gone{reason}    bye, dead (heartbeats missed), restarted (new session), replaced (another learner)
    state_writes{trigger} sync writes of the state file
    unknown_fields{kind}  messages holding fields this release does not know (a newer client of the same protocol
                          version): accepted, the fields ignored (common/protocol.py's compatibility rule)
    policy_mismatches{reason}  groups the learner's policy check failed (BatchAck.mismatches): logprobs,
                          adapter_sha256, lora_id_reused, no_evidence (common/integrity.py)
    quarantines{event}    quarantined (a worker process), probation (its restart joined), cleared (a group of a
                          process on probation passed); loraflow.broker.quarantine
    loop_passes{le_ms}    the loop's passes by duration, each counted under its bucket's upper bound in ms (1, 2, 5,
                          ..., 1000, inf: not cumulative); loraflow.broker.loop_times, which also gives Stats ``loop``
    gc_collections{generation}  Python's garbage collections in the broker's process while it serves (0, 1, 2)
    connections{event}    accepted / disconnected TCP connections (zmq drops a peer that sends a frame over
                          broker.max_message_bytes before anything is read: it shows up here)
    auth{event}           failed handshakes, none of which gets a message through (so they appear nowhere
                          else): refused (a key not authorised, security.enabled), wrong_server_key (a CURVE
                          client with another broker public key), plaintext (a client without CURVE),
                          curve_client (a CURVE client while security is off), dropped (the client hung up
                          mid-handshake: also how a plaintext client may show), handshake_failed (other)

Gauges (``loraflow_broker_<name>``), set once per tick by the core: ``quarantined_workers`` and
``probation_workers`` among the others (buffer, leases, waiters).

The snapshot's ``encryption`` says whether the broker's socket uses CURVE (``curve``) or not (``off``).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from loraflow.common.metrics import Metrics

#: rate name -> the total it is the rate of
RATES = {"messages_in_per_s": "messages_in", "messages_out_per_s": "messages_out", "bytes_in_per_s": "bytes_in",
         "bytes_out_per_s": "bytes_out", "groups_per_s": "groups_accepted", "tokens_per_s": "tokens_accepted",
         "trained_groups_per_s": "groups_trained"}


class BrokerStats:
    """Counters by family and reason, plus windowed rates of the totals."""

    def __init__(self, metrics: Metrics | None = None, *, window_s: float = 10.0) -> None:
        self.metrics = metrics or Metrics(namespace="loraflow_broker")
        self.window_s = window_s
        self.families: dict[str, tuple[str, Counter[str]]] = {
            name: (label, Counter()) for name, label in (
                ("messages_in", "kind"), ("messages_out", "kind"), ("rejected", "reason"), ("dropped", "reason"),
                ("send_failed", "reason"), ("groups", "event"), ("leases", "event"),
                ("served_staleness", "staleness"), ("adapters", "event"), ("peers_gone", "reason"),
                ("state_writes", "trigger"), ("connections", "event"), ("auth", "event"),
                ("policy_mismatches", "reason"), ("quarantines", "event"), ("unknown_fields", "kind"),
                ("loop_passes", "le_ms"), ("gc_collections", "generation"))
        }
        self.bytes_in = 0
        self.bytes_out = 0
        self.tokens_accepted = 0
        self.encryption = "off"  # "curve" when the broker's socket is a CURVE server (set by the server)
        self._pushed: dict[tuple[str, str], float] = {}
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def count(self, family: str, key: Any, amount: int = 1) -> None:
        self.families[family][1][str(key)] += amount

    def get(self, family: str, key: Any) -> int:
        return self.families[family][1][str(key)]

    def family(self, family: str) -> dict[str, int]:
        return {k: v for k, v in sorted(self.families[family][1].items()) if v}

    def totals(self) -> dict[str, float]:
        groups = self.families["groups"][1]
        return {"messages_in": sum(self.families["messages_in"][1].values()),
                "messages_out": sum(self.families["messages_out"][1].values()),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "groups_accepted": groups["accepted"], "groups_trained": groups["trained"],
                "tokens_accepted": self.tokens_accepted}

    def tick(self, now_s: float) -> None:
        """Keep a sample for rates and push counter deltas to the Prometheus metrics."""
        self._samples.append((now_s, self.totals()))
        while len(self._samples) > 2 and now_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        for name, (label, counter) in self.families.items():
            for key, value in counter.items():
                self._push(name, value, **{label: key})
        self._push("bytes_in", self.bytes_in)
        self._push("bytes_out", self.bytes_out)
        self._push("tokens_accepted", self.tokens_accepted)

    def _push(self, name: str, value: float, **labels: str) -> None:
        ident = (name, ",".join(f"{k}={v}" for k, v in labels.items()))
        delta = value - self._pushed.get(ident, 0)
        if delta:
            self.metrics.inc(name, delta, **labels)
            self._pushed[ident] = value

    def rates(self, now_s: float) -> dict[str, float]:
        """Per-second rates over the window (the oldest kept sample to now)."""
        if not self._samples:
            return {name: 0.0 for name in RATES}
        then, old = self._samples[0]
        elapsed = now_s - then
        current = self.totals()
        if elapsed <= 0:
            return {name: 0.0 for name in RATES}
        return {name: round((current[total] - old[total]) / elapsed, 3) for name, total in RATES.items()}

    def snapshot(self, now_s: float) -> dict[str, Any]:
        return {
            "messages_in": self.family("messages_in"),
            "messages_out": self.family("messages_out"),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "rejected": self.family("rejected"),
            "num_rejected": sum(self.families["rejected"][1].values()),
            "dropped": self.family("dropped"),
            "send_failed": self.family("send_failed"),
            "group_events": self.family("groups"),
            "lease_events": self.family("leases"),
            "served_staleness": {k: v for k, v in sorted(self.family("served_staleness").items(),
                                                         key=lambda kv: int(kv[0]))},
            "adapter_events": self.family("adapters"),
            "peers_gone": self.family("peers_gone"),
            "connections": self.family("connections"),
            "auth": self.family("auth"),
            "unknown_fields": self.family("unknown_fields"),
            "encryption": self.encryption,
            "state_writes": sum(self.families["state_writes"][1].values()),
            "tokens_accepted": self.tokens_accepted,
            "rates": self.rates(now_s),
        }
