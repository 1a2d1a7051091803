"""Parked long-polls: the broker loop's stall when thousands of LeaseRequests expire, before and after.

An outside client found that parked LeaseRequests were unbounded per worker and expired in O(n^2) (a
``deque.remove`` per expired waiter in ``BrokerCore.tick``): 8,000 parked requests stalled the loop seconds.
Now a worker has at most one parked request (a newer one replaces it) and deadlines sit in a heap
(:mod:`loraflow.broker.outbox`).

Two figures, both printed:

- the expiry itself, ``n`` waiters of which every other one is due: the old loop (the exact lines it had, on a deque) against
  ``WaiterQueue.expired`` — the reference is the old loop's time, the value the new one's;
- end to end against a real ``python -m loraflow.broker``: one raw worker sends ``n`` LeaseRequests (wait_ms=1000)
  while nothing can be leased, and an observer measures the longest StatsRequest round trip while they park
  and expire (the loop's stall as a client sees it) and how many waiters the broker holds.

    python -m bench.broker_waiters [--num-requests 8000]
"""

from __future__ import annotations

import tempfile
import time
from collections import deque
from pathlib import Path

import zmq

from bench import harness
from bench.broker_proc import start_broker
from bench.harness import codec
from bench.report import report
from loraflow.broker.outbox import Waiter, WaiterQueue
from loraflow.common.protocol import Hello, LeaseRequest, StatsRequest


def deadline_of(i: int) -> float:
    """Every other waiter is due (requests with different wait_ms interleave in arrival order)."""
    return 1.0 if i % 2 == 0 else 3.0


def old_expiry_s(n: int) -> float:
    """The loop BrokerCore.tick had: a list of the due waiters, then deque.remove for each (a scan from the
    front comparing dataclass waiters field by field)."""
    waiters = deque(Waiter(identity=f"w{i}".encode(), request=None, deadline_s=deadline_of(i)) for i in range(n))
    started = time.perf_counter()
    if waiters and min(w.deadline_s for w in waiters) <= 2.0:
        for waiter in [w for w in waiters if w.deadline_s <= 2.0]:
            waiters.remove(waiter)
    return time.perf_counter() - started


def new_expiry_s(n: int) -> float:
    waiters = WaiterQueue()
    for i in range(n):
        waiters.park(Waiter(identity=f"w{i}".encode(), request=None, deadline_s=deadline_of(i)))
    started = time.perf_counter()
    assert len(waiters.expired(2.0)) == (n + 1) // 2
    return time.perf_counter() - started


def stall_against_a_broker(n: int) -> tuple[float, int]:
    """(longest Stats round trip in ms while n parked requests arrive and expire, waiters held at the peak)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, endpoint = start_broker(Path(tmp), "run.group_size=2", "run.groups_per_step=1",
                                     "broker.capacity_groups=1")
        ctx = zmq.Context()
        try:
            worker, observer = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
            worker.setsockopt(zmq.IDENTITY, b"worker/greedy")
            for sock in (worker, observer):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
            worker.send_multipart(codec.encode(Hello(role="worker", client_id="greedy", session="s")))
            worker.recv_multipart()
            worker.send_multipart(codec.encode(LeaseRequest(max_leases=1, wait_ms=0)))  # the one lease there is
            worker.recv_multipart()
            request = codec.encode(LeaseRequest(max_leases=1, wait_ms=1000))
            for _ in range(n):
                worker.send_multipart(request)
            longest_ms, peak_waiters, deadline = 0.0, 0, time.monotonic() + 4.0
            while time.monotonic() < deadline:
                sent = time.perf_counter()
                observer.send_multipart(codec.encode(StatsRequest()))
                stats, _ = codec.decode(observer.recv_multipart())
                longest_ms = max(longest_ms, (time.perf_counter() - sent) * 1000)
                peak_waiters = max(peak_waiters, stats.snapshot["waiting"]["lease_requests"])
                time.sleep(0.01)
            return longest_ms, peak_waiters
        finally:
            ctx.destroy(linger=0)
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--num-requests", type=int, default=8000)
    args = harness.parse(parser, None, num_requests=500)
    n = args.num_requests
    before = min(old_expiry_s(n) for _ in range(3))
    after = min(new_expiry_s(n) for _ in range(3))
    print(f"expiring {n // 2} of {n} waiters: old deque loop {before * 1000:.1f} ms, heap {after * 1000:.2f} ms "
          f"({before / after:.0f}x)")
    longest_ms, peak = stall_against_a_broker(n)
    print(f"real broker, one worker sending {n} parked LeaseRequests: waiters held at most {peak}, longest Stats "
          f"round trip meanwhile {longest_ms:.1f} ms")
    report("broker_waiters", "expiry_ms", after * 1000, "ms", before * 1000, num_requests=n,
           broker_waiters_held=peak, broker_longest_stats_rtt_ms=round(longest_ms, 1))


if __name__ == "__main__":
    main()
