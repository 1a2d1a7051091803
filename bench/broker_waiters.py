"""Parked long-polls: the broker loop's stall when thousands of LeaseRequests expire.

    .venv/bin/python -m bench.broker_waiters [--num-requests 8000]

A worker has at most one parked LeaseRequest (a newer one replaces it) and deadlines sit in a heap
(:mod:`loraflow.broker.outbox`). Two figures: expiring every other one of ``n`` waiters with ``WaiterQueue``
against the loop ``BrokerCore.tick`` had (a ``deque.remove`` per due waiter, O(n^2)), in this process; and
against a real broker, one raw worker sending ``n`` parked LeaseRequests while nothing can be leased, the
waiters it holds and the longest StatsRequest round trip meanwhile (the loop's stall as a client sees it).
"""

from __future__ import annotations

import tempfile
import time
from collections import deque
from pathlib import Path

import zmq

from bench import harness
from bench.harness import codec
from loraflow.broker.outbox import Waiter, WaiterQueue
from loraflow.common.protocol import LeaseRequest, StatsRequest


def waiters(n: int) -> list[Waiter]:
    """``n`` waiters of which every other one is due at 2.0 (requests with different wait_ms interleave)."""
    return [Waiter(identity=f"w{i}".encode(), request=None, deadline_s=3.0 if i % 2 else 1.0) for i in range(n)]


def old_expiry_s(n: int) -> float:
    """The loop BrokerCore.tick had: the due waiters listed, then ``deque.remove`` for each."""
    queue = deque(waiters(n))
    started = time.perf_counter()
    if queue and min(w.deadline_s for w in queue) <= 2.0:
        for waiter in [w for w in queue if w.deadline_s <= 2.0]:
            queue.remove(waiter)
    return time.perf_counter() - started


def new_expiry_s(n: int) -> float:
    queue = WaiterQueue()
    for waiter in waiters(n):
        queue.park(waiter)
    started = time.perf_counter()
    assert len(queue.expired(2.0)) == (n + 1) // 2
    return time.perf_counter() - started


def stall_against_a_broker(n: int) -> tuple[float, int]:
    """(longest Stats round trip in ms while n parked requests arrive and expire, waiters held at the peak)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, endpoint = harness.start_broker(Path(tmp), "run.group_size=2", "run.groups_per_step=1",
                                              "broker.capacity_groups=1")
        ctx = zmq.Context()
        try:
            worker, observer = harness.dealer(ctx, endpoint, "worker", "greedy"), ctx.socket(zmq.DEALER)
            observer.connect(endpoint)
            worker.send_multipart(codec.encode(LeaseRequest(max_leases=1, wait_ms=0)))  # the one lease there is
            worker.recv_multipart()
            for _ in range(n):
                worker.send_multipart(codec.encode(LeaseRequest(max_leases=1, wait_ms=1000)))
            longest_ms, peak, deadline = 0.0, 0, time.monotonic() + 4.0
            while time.monotonic() < deadline:
                sent = time.perf_counter()
                observer.send_multipart(codec.encode(StatsRequest()))
                stats, _ = codec.decode(observer.recv_multipart())
                longest_ms = max(longest_ms, (time.perf_counter() - sent) * 1000)
                peak = max(peak, stats.snapshot["waiting"]["lease_requests"])
                time.sleep(0.01)
            return longest_ms, peak
        finally:
            ctx.destroy(linger=0)
            harness.reap([], proc)


def main() -> None:
    n = harness.parse(harness.flags(harness.parser(__doc__), {"num_requests": 8000}), None,
                      num_requests=500).num_requests
    before = min(old_expiry_s(n) for _ in range(3))
    after = min(new_expiry_s(n) for _ in range(3))
    longest_ms, peak = stall_against_a_broker(n)
    harness.table(["measured", "before", "after"], [
        [f"expiring {n // 2} of {n} parked waiters", f"{before * 1000:.1f} ms (deque.remove)",
         f"{after * 1000:.2f} ms (heap, {before / after:.0f}x)"],
        [f"one worker sending {n} parked LeaseRequests: waiters held", "", peak],
        ["longest StatsRequest round trip meanwhile", "", f"{longest_ms:.1f} ms"]])
    harness.report("broker_waiters", "expiry_ms", after * 1000, "ms", before * 1000, num_requests=n,
                   broker_waiters_held=peak, broker_longest_stats_rtt_ms=round(longest_ms, 1))


if __name__ == "__main__":
    main()
