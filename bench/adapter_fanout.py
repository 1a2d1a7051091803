"""Adapter relay fan-out: time until every worker holds a 50 MB adapter, against one direct send of its bytes.

    .venv/bin/python -m bench.adapter_fanout [--mb 50] [--workers 1,4,16] [--repeats 3]

A learner publishes an AdapterUpdate (``--mb`` MB of float32 LoRA tensors, PEFT names) to ``python -m
loraflow.broker``; N worker processes get the AdapterNotice, fetch, and note when the whole update arrived
(``time.monotonic`` is system-wide). The reference is the same bytes sent once over a direct PUSH -> PULL pair:
each worker needs its own copy on the wire, so N x the direct time is the floor of a relay without multicast.
The JSON line reports the largest N.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import zmq

from bench import harness
from bench.harness import adapter_tensors, codec
from loraflow.common import framing
from loraflow.common.protocol import AdapterFetch, AdapterUpdate, Kind


def fetchers(endpoint: str, first: int, n: int, ready: mp.Queue, received: mp.Queue) -> None:
    """``n`` workers (DEALERs of this process) that fetch every announced adapter; put (version, monotonic time
    it was complete, tensor bytes) for each arrival."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 64)
    socks = [harness.dealer(ctx, endpoint, "worker", f"fan{first + i}") for i in range(n)]
    ready.put(n)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            frames = sock.recv_multipart(copy=False)
            kind, header = harness.kind_and_header(frames)
            if kind == Kind.ADAPTER_NOTICE:
                sock.send_multipart(codec.encode(AdapterFetch(version=header["version"])))
            elif kind == Kind.ADAPTER_UPDATE:
                received.put((header["version"], time.monotonic(), sum(len(f) for f in frames[2:])))
            del frames  # the adapter's bytes go at once


def direct_receiver(ready: mp.Queue, received: mp.Queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("tcp://127.0.0.1:*")
    ready.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while len(frames := sock.recv_multipart(copy=False)) > 1:
        received.put((0, time.monotonic(), sum(len(f) for f in frames[2:])))


def direct_time(message: list, repeats: int) -> float:
    """Median seconds of one PUSH -> PULL send of ``message`` to another process (the first send not counted)."""
    ready, received = (mp.get_context("spawn").Queue() for _ in range(2))
    receiver = harness.spawn(direct_receiver, ready, received)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(ready.get(timeout=30))
    times = []
    for _ in range(repeats + 1):
        started = time.monotonic()
        sock.send_multipart(message, copy=False)
        times.append(received.get(timeout=60)[1] - started)
    sock.send(b"")
    harness.reap([receiver])
    ctx.destroy(linger=0)
    return harness.median(times[1:])


def fanout_times(tensors: list, num_workers: int, repeats: int, workdir: Path, *, per_process: int = 1,
                 warmup: bool = True, overrides: tuple[str, ...] = ("broker.num_adapters_kept=2",)) -> list[list[float]]:
    """For each of ``repeats`` publishes (after one warm-up publish, unless not ``warmup``): the seconds from the
    send until each of ``num_workers`` fetchers (``per_process`` to a process) held the whole adapter, sorted."""
    workdir.mkdir(parents=True, exist_ok=True)
    broker, endpoint = harness.start_broker(workdir, *overrides)
    ready, received = (mp.get_context("spawn").Queue() for _ in range(2))
    procs = [harness.spawn(fetchers, endpoint, first, min(per_process, num_workers - first), ready, received)
             for first in range(0, num_workers, per_process)]
    ctx = zmq.Context()
    try:
        for _ in procs:
            ready.get(timeout=180)
        learner = harness.dealer(ctx, endpoint, "learner", "fanout")
        expected = sum(a.nbytes for _, a in tensors)
        sha256 = framing.frames_sha256([a for _, a in tensors])
        out = []
        for version in range(1, repeats + 1 + warmup):
            update = AdapterUpdate(version=version, step=version, sha256=sha256,
                                   adapter_config={"r": 16, "lora_alpha": 32, "peft_type": "LORA"})
            started = time.monotonic()
            learner.send_multipart(codec.encode(update, tensors), copy=False)
            arrivals = [received.get(timeout=600) for _ in range(num_workers)]
            assert all(v == version and n == expected for v, _, n in arrivals), "a worker got another adapter"
            out.append(sorted(t - started for _, t, _ in arrivals))
            while learner.poll(0):  # the publish Ack
                learner.recv_multipart()
        return out[warmup:]  # the warm-up publish also sets up connections and the state file
    finally:
        ctx.destroy(linger=0)
        for proc in procs:
            proc.kill()
        harness.reap(procs, broker)


def main(argv: list[str] | None = None) -> int:
    parser = harness.flags(harness.parser(__doc__, repeats=3), {"mb": (50.0, "adapter size in MB"),
                                                                "workers": "1,4,16"})
    args = harness.parse(parser, argv, mb=2.0, workers="1,2", repeats=1)
    tensors = adapter_tensors(int(args.mb * (1 << 20)))
    num_bytes = sum(a.nbytes for _, a in tensors)
    reference = direct_time(codec.encode(AdapterUpdate(version=1, sha256="", adapter_config={}), tensors), args.repeats)
    print(f"adapter {num_bytes / (1 << 20):.1f} MB in {len(tensors)} tensors; direct send {reference * 1000:.1f} ms "
          f"({num_bytes / reference / 1e6:.0f} MB/s)", flush=True)
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-fanout-", dir=harness.REPO) as tmp:
        for n in harness.sizes(args.workers):
            times = [last for *_, last in fanout_times(tensors, n, args.repeats, Path(tmp) / f"n{n}")]
            results[n] = harness.median(times)
            rows.append([n, f"{results[n] * 1000:.0f} ms", f"{results[n] / reference:.2f}",
                         f"{results[n] / reference / n:.2f}", ", ".join(f"{t * 1000:.0f}" for t in times) + " ms"])
    harness.table(["workers", "all hold it after", "/ direct send", "/ direct send / workers", "runs"], rows)
    largest = max(results)
    harness.report("adapter_fanout", f"time until {largest} workers hold a {args.mb:g} MB adapter",
                   results[largest] * 1000, "ms", reference * 1000, num_workers=largest,
                   ratio_by_workers={str(n): round(t / reference, 2) for n, t in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
