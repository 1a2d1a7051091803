"""The broker loop's pass times (loraflow.broker.stats.LoopTimes): buckets, windows, the slowest step, and a real broker's Stats."""

from __future__ import annotations

import gc
import time

import zmq

from loraflow.broker.stats import BUCKET_LABELS, BrokerStats, LoopTimes, pass_quantile
from loraflow.common import codec
from loraflow.common.protocol import Hello, LeaseRequest
from loraflow.deploy import status
from tests.support import Processes, start_broker


def test_passes_land_in_the_bucket_of_their_upper_bound() -> None:
    times = LoopTimes(BrokerStats())
    for seconds in (0.0002, 0.001, 0.0011, 0.019, 0.021, 2.0):
        times.pass_done(seconds, seconds / 2)
    passes = times.snapshot()["passes"]
    assert set(passes) == set(BUCKET_LABELS)
    assert (passes["1"], passes["2"], passes["20"], passes["50"], passes["inf"]) == (2, 1, 1, 1, 1)
    assert sum(passes.values()) == 6
    assert times.stats.snapshot(0.0)["rates"] is not None  # the family is an ordinary stats counter
    assert times.stats.family("loop_passes") == {"1": 2, "2": 1, "20": 1, "50": 1, "inf": 1}


def test_the_window_keeps_the_slowest_pass_and_step_by_name() -> None:
    times = LoopTimes(BrokerStats(), window_s=10.0)
    times.roll(100.0)
    times.step("heartbeat", 0.0001)
    times.step("batch_request", 0.030)
    times.step("flush", 0.002)
    times.pass_done(0.0325, 0.004)
    times.pass_done(0.0005, 0.0005)
    current = times.snapshot()  # no full window yet: the current one
    assert (current["slowest_step"], current["slowest_step_ms"]) == ("batch_request", 30.0)
    assert current["slowest_pass_ms"] == 32.5 and current["window_passes"] == 2
    assert current["slowest_pass_cpu_ms"] == 4.0  # the slowest pass's own CPU, not the largest CPU
    times.roll(105.0)  # not yet 10 s: same window
    times.step("tick", 0.001)
    times.roll(110.0)  # the window closes; the next starts empty
    last = times.snapshot()
    assert last["window_s"] == 10.0 and last["slowest_step"] == "batch_request"
    assert last["busy_share"] == round(0.033 / 10.0, 4)
    times.step("lease_request", 0.004)
    times.roll(121.0)
    assert times.snapshot()["slowest_step"] == "lease_request"  # the window before is forgotten


def test_garbage_collections_are_counted_and_timed() -> None:
    times = LoopTimes(BrokerStats())
    gc.callbacks.append(times.on_gc)
    try:
        garbage = [[] for _ in range(20_000)]
        for a, b in zip(garbage, garbage[1:], strict=False):
            a.append(b), b.append(a)  # cycles: only the collector frees them
        del garbage, a, b
        gc.collect(2)
    finally:
        gc.callbacks.remove(times.on_gc)
    snap = times.snapshot()
    assert snap["gc_collections"].get("2", 0) >= 1
    assert snap["slowest_gc_generation"] == 2 and snap["slowest_gc_ms"] > 0
    assert snap["window_gc_ms"] >= snap["slowest_gc_ms"]


def test_pass_quantile_reads_the_bucket_bounds() -> None:
    assert pass_quantile({}, 0.99) == 0.0
    passes = {"1": 980, "5": 15, "50": 5}
    assert pass_quantile(passes, 0.5) == 1.0
    assert pass_quantile(passes, 0.99) == 5.0
    assert pass_quantile(passes, 1.0) == 50.0
    assert pass_quantile({"inf": 1}, 0.5) == float("inf")


def test_a_real_broker_reports_its_loop_in_stats_and_status(procs: Processes) -> None:
    broker = start_broker(procs, "run.group_size=2", "run.groups_per_step=2")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.endpoint)
    try:
        sock.send_multipart(codec.encode(Hello(role="worker", client_id="w-loop")))
        assert sock.poll(5000)
        sock.recv_multipart()
        sock.send_multipart(codec.encode(LeaseRequest(max_leases=1)))
        assert sock.poll(5000)
        sock.recv_multipart()
        deadline = time.monotonic() + 10
        while True:
            loop = broker.stats()["loop"]
            if loop["slowest_step"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        sock.close()
    assert sum(loop["passes"].values()) >= 2  # at least the Hello's and the LeaseRequest's passes
    assert loop["slowest_step"] in {"hello", "lease_request", "stats_request", "tick", "flush"}
    assert 0 < loop["slowest_pass_ms"] < 1000 and 0 <= loop["slowest_pass_cpu_ms"] <= loop["slowest_pass_ms"] + 1
    assert {"gc_collections", "slowest_gc_ms", "slowest_gc_generation"} <= set(loop)
    assert loop["gc_frozen"] > 10_000  # startup's objects are out of the collector's walks (loraflow.broker.main)
    line = status.loop_line(loop)
    assert line.startswith("loop      busy ") and "slowest step" in line
