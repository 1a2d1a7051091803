"""Adapter relay fan-out: time until every worker holds a 50 MB adapter, against one direct send of its bytes.

    .venv/bin/python -m bench.adapter_fanout [--mb 50] [--workers 1,4,16] [--repeats 3]

A learner process publishes an AdapterUpdate (``--mb`` MB of float32 LoRA tensors with PEFT names) to
``python -m loraflow.broker``; N worker processes get the AdapterNotice, fetch, and record when the whole
AdapterUpdate has arrived (``time.monotonic`` is system-wide, so processes' clocks agree). The broker checks
the sha256, keeps the received frames and forwards the same frames to every fetcher (no copies in Python;
zmq's I/O thread still writes the bytes to each socket), and saves the adapter in its state writer thread.

Reference, in the same run: the same bytes sent once over a direct PUSH -> PULL pair between two processes.
The ratio (time for N workers / direct time) should grow no faster than N: each worker needs its own copy
on the wire, so N x the direct time is the floor of any relay without multicast. The JSON line reports the
largest N.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from bench import harness
from bench.broker_proc import start_broker
from bench.harness import codec
from bench.report import report
from loraflow.common.protocol import AdapterFetch, AdapterUpdate, Kind

REPO = Path(__file__).resolve().parent.parent


def adapter_tensors(num_bytes: int) -> list[tuple[str, np.ndarray]]:
    """LoRA A/B pairs of 7 projections x n layers (float32), about ``num_bytes`` in all."""
    names = [f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.weight"
             for layer in range(8) for proj in ("q_proj", "k_proj", "v_proj", "o_proj") for ab in ("A", "B")]
    per_tensor = max(1, num_bytes // (4 * len(names)))
    rng = np.random.default_rng(0)
    return [(name, rng.standard_normal(per_tensor, dtype=np.float32)) for name in names]


def worker(endpoint: str, index: int, ready: mp.Queue, received: mp.Queue) -> None:
    """Fetch every announced adapter; report (version, monotonic time when it was complete, bytes)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"worker/fan{index}".encode())
    sock.connect(endpoint)
    harness.hello(sock, "worker", f"fan{index}")
    ready.put(index)
    while True:
        frames = sock.recv_multipart(copy=False)
        kind, header = harness.kind_and_header(frames)
        if kind == Kind.ADAPTER_NOTICE:
            sock.send_multipart(codec.encode(AdapterFetch(version=header["version"])))
        elif kind == Kind.ADAPTER_UPDATE:
            received.put((header["version"], time.monotonic(), sum(len(f) for f in frames[2:])))
        elif kind == Kind.BYE:
            break


def direct_receiver(ready: mp.Queue, received: mp.Queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("tcp://127.0.0.1:*")
    ready.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1:
            break
        received.put((0, time.monotonic(), sum(len(f) for f in frames[2:])))


def direct_time(message: list, repeats: int) -> float:
    spawn = mp.get_context("spawn")
    ready, received = spawn.Queue(), spawn.Queue()
    receiver = spawn.Process(target=direct_receiver, args=(ready, received))
    receiver.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(ready.get(timeout=30))
    times = []
    for _ in range(repeats + 1):  # the first send also sets up the connection: not counted
        started = time.monotonic()
        sock.send_multipart(message, copy=False)
        times.append(received.get(timeout=60)[1] - started)
    sock.send(b"")
    receiver.join(timeout=10)
    sock.close(linger=0)
    ctx.term()
    return statistics.median(times[1:])


def fanout_times(tensors: list, num_workers: int, repeats: int, first_version: int, workdir: Path) -> list[float]:
    spawn = mp.get_context("spawn")
    broker, endpoint = start_broker(workdir / f"n{num_workers}", "broker.num_adapters_kept=2")
    ready, received = spawn.Queue(), spawn.Queue()
    workers = [spawn.Process(target=worker, args=(endpoint, i, ready, received), daemon=True)
               for i in range(num_workers)]
    ctx = zmq.Context()
    learner = ctx.socket(zmq.DEALER)
    learner.setsockopt(zmq.IDENTITY, b"learner/fanout")
    learner.connect(endpoint)
    try:
        for proc in workers:
            proc.start()
        for _ in workers:
            ready.get(timeout=60)
        harness.hello(learner, "learner", "fanout")
        digest = hashlib.sha256()
        for _, array in tensors:
            digest.update(array)
        times = []
        for version in range(first_version, first_version + repeats + 1):
            update = AdapterUpdate(version=version, step=version, sha256=digest.hexdigest(),
                                   adapter_config={"r": 16, "lora_alpha": 32, "peft_type": "LORA"})
            started = time.monotonic()
            learner.send_multipart(codec.encode(update, tensors), copy=False)
            arrivals = [received.get(timeout=120) for _ in workers]
            assert all(v == version for v, _, _ in arrivals), arrivals
            expected = sum(a.nbytes for _, a in tensors)
            assert all(n == expected for _, _, n in arrivals), "a worker got a truncated adapter"
            times.append(max(t for _, t, _ in arrivals) - started)
            while learner.poll(0):  # the publish Ack
                learner.recv_multipart()
        return times[1:]  # the first publish also warms up connections and the state file
    finally:
        learner.close(linger=0)
        ctx.term()
        broker.terminate()
        broker.wait(timeout=30)
        for proc in workers:
            proc.terminate()


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, repeats=3)
    parser.add_argument("--mb", type=float, default=50.0, help="adapter size in MB")
    parser.add_argument("--workers", default="1,4,16")
    args = harness.parse(parser, argv, mb=2.0, workers="1,2", repeats=1)
    tensors = adapter_tensors(int(args.mb * (1 << 20)))
    num_bytes = sum(a.nbytes for _, a in tensors)
    message = codec.encode(AdapterUpdate(version=1, sha256="", adapter_config={}), tensors)
    reference = direct_time(message, args.repeats)
    print(f"adapter {num_bytes / (1 << 20):.1f} MB in {len(tensors)} tensors; direct send {reference * 1000:.1f} ms "
          f"({num_bytes / reference / 1e6:.0f} MB/s)", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-fanout-", dir=REPO) as tmp:
        for n in [int(x) for x in args.workers.split(",")]:
            times = fanout_times(tensors, n, args.repeats, 1, Path(tmp))
            results[n] = statistics.median(times)
            print(f"{n:>3} workers: all hold it after {results[n] * 1000:7.1f} ms  ratio {results[n] / reference:6.2f}"
                  f"  ratio per worker {results[n] / reference / n:5.2f}  runs "
                  f"{', '.join(f'{t * 1000:.0f}' for t in times)} ms", flush=True)
    largest = max(results)
    report("adapter_fanout", f"time until {largest} workers hold a {args.mb:g} MB adapter", results[largest] * 1000,
           "ms", reference * 1000, num_workers=largest,
           ratio_by_workers={str(n): round(t / reference, 2) for n, t in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
