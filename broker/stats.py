"""What the broker counts and times: counters, rates and histograms (:class:`BrokerStats`) and the loop's
pass times (:class:`LoopTimes`), and how they reach a Stats reply and Prometheus.

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
                          ..., 1000, inf: not cumulative); :class:`LoopTimes`, which also gives Stats ``loop``
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

How long the loop is busy. The loop (:mod:`loraflow.broker.server`) is one thread: while a pass runs, nothing
else is read or sent, so a slow pass is latency for every peer at once (a lease grant, a heartbeat's answer).
:class:`LoopTimes` owns what the operator and the benches need to see it: the passes by duration (``loop_passes{le_ms}``: counters by the bucket's upper
bound in ms, so a Prometheus rate or two Stats snapshots give a distribution) and, over the last stats window,
the slowest pass (wall time, and how much of it the loop's thread was on the CPU: a pass much longer than
its CPU time waited for a core or for the GIL, not for its own work) and the slowest single step with its name: a
message kind (``lease_request``, ``heartbeat``, ...), ``tick`` (timers: expiries, dead peers, parked long-polls)
or ``flush`` (serving parked requests, AdapterNotices, the state write's hand-off, the sends). The Stats reply
carries it as ``loop``; ``loraflow status`` prints it. Python's garbage collections are timed too
(:meth:`LoopTimes.on_gc`): a full one stops the loop for as long as it walks the heap.

A pass's time is the loop's work between two polls (what it received, the tick, the flush and the sends), not
the poll's wait and not the gather sleep (:data:`loraflow.broker.server.GATHER_S`). Two clock reads per message and
six per pass (two of the thread's CPU clock): about a microsecond a pass.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
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


#: upper bounds of the pass-duration buckets (ms); a pass longer than the last lands in "inf"
BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
BUCKET_LABELS = tuple(str(b) for b in BUCKETS_MS) + ("inf",)


class LoopTimes:
    """Pass durations into ``stats``' ``loop_passes`` counters; the slowest pass and step of the current and
    the last window (:meth:`roll`, once per stats tick)."""

    def __init__(self, stats: BrokerStats, *, window_s: float = 10.0) -> None:
        self.stats = stats
        self.window_s = window_s
        self._window_start_s: float | None = None
        self._current = _Window()
        self._last = _Window()
        self._gc_started_s = 0.0

    def step(self, what: str, seconds: float) -> None:
        """One message handled (``what`` its kind), or the pass's tick or flush, took ``seconds``."""
        window = self._current
        if seconds > window.slowest_step_s:
            window.slowest_step_s, window.slowest_step = seconds, what

    def pass_done(self, seconds: float, cpu_s: float) -> None:
        """A pass (receive, tick, flush, sends) took ``seconds`` of the loop, ``cpu_s`` of them on the CPU (the
        rest: the thread waited for the GIL or for a core)."""
        self.stats.count("loop_passes", BUCKET_LABELS[bisect_left(BUCKETS_MS, seconds * 1e3)])
        window = self._current
        window.num_passes += 1
        window.busy_s += seconds
        if seconds > window.slowest_pass_s:
            window.slowest_pass_s, window.slowest_pass_cpu_s = seconds, cpu_s

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry (the server installs it while it serves): each collection counted by
        generation (``gc_collections{generation}``), the slowest of the window kept with its generation. A
        full collection walks every tracked object, so with thousands of peers it is a pass's likeliest stall."""
        if phase == "start":
            self._gc_started_s = time.perf_counter()
            return
        seconds = time.perf_counter() - self._gc_started_s
        generation = info.get("generation", -1)
        self.stats.count("gc_collections", generation)
        window = self._current
        window.gc_s += seconds
        if seconds > window.slowest_gc_s:
            window.slowest_gc_s, window.slowest_gc_generation = seconds, generation

    def roll(self, now_s: float) -> None:
        """Start a new window when the current one is ``window_s`` old."""
        if self._window_start_s is None:
            self._window_start_s = now_s
        elif now_s - self._window_start_s >= self.window_s:
            self._last, self._current = self._current, _Window()
            self._last.seconds = now_s - self._window_start_s
            self._window_start_s = now_s

    def snapshot(self) -> dict[str, Any]:
        """The Stats reply's ``loop``: the last full window (the current one until a window has passed)."""
        window = self._last if self._last.seconds else self._current
        return {"passes": {label: self.stats.get("loop_passes", label) for label in BUCKET_LABELS},
                "window_s": round(window.seconds, 3), "window_passes": window.num_passes,
                "busy_share": round(window.busy_s / window.seconds, 4) if window.seconds else None,
                "slowest_pass_ms": round(window.slowest_pass_s * 1e3, 3),
                "slowest_pass_cpu_ms": round(window.slowest_pass_cpu_s * 1e3, 3),
                "slowest_step": window.slowest_step, "slowest_step_ms": round(window.slowest_step_s * 1e3, 3),
                "gc_collections": self.stats.family("gc_collections"), "window_gc_ms": round(window.gc_s * 1e3, 3),
                "slowest_gc_ms": round(window.slowest_gc_s * 1e3, 3),
                "slowest_gc_generation": window.slowest_gc_generation, "gc_frozen": gc.get_freeze_count()}


class _Window:
    __slots__ = ("seconds", "num_passes", "busy_s", "slowest_pass_s", "slowest_pass_cpu_s", "slowest_step",
                 "slowest_step_s", "gc_s", "slowest_gc_s", "slowest_gc_generation")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.num_passes = 0
        self.busy_s = 0.0
        self.slowest_pass_s = 0.0
        self.slowest_pass_cpu_s = 0.0
        self.slowest_step = ""
        self.slowest_step_s = 0.0
        self.gc_s = 0.0
        self.slowest_gc_s = 0.0
        self.slowest_gc_generation = -1


def pass_quantile(passes: dict[str, int], q: float) -> float:
    """The upper bound (ms) of the bucket holding quantile ``q`` of ``passes`` (a ``loop.passes`` map or the
    difference of two); inf past the last bucket, 0 for no passes."""
    total = sum(passes.values())
    if not total:
        return 0.0
    seen = 0
    for label in BUCKET_LABELS:
        seen += passes.get(label, 0)
        if seen >= q * total:
            return float(label)
    return float("inf")
