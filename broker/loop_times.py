"""How long the broker's loop is busy: each pass's time and the slowest piece of work, by what it was.

The loop (:mod:`loraflow.broker.server`) is one thread: while a pass runs, nothing else is read or sent, so a slow pass
is latency for every peer at once (a lease grant, a heartbeat's answer). This object owns what the operator
and the benches need to see it: the passes by duration (``loop_passes{le_ms}``: counters by the bucket's upper
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
from typing import Any

from loraflow.broker.stats import BrokerStats

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
