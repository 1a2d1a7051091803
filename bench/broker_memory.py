"""Broker memory with a full buffer: resident size against the configured byte bound (+ 150 MB allowed).

    .venv/bin/python -m bench.broker_memory [--bound-mb 256] [--group-kb 1024]

Starts ``python -m loraflow.broker`` with ``broker.max_buffer_bytes`` = ``--bound-mb`` and room for many groups, then a
producer (a worker) fills the buffer with rollout groups of ``--group-kb`` until the broker stops granting
leases (its byte bound) and refuses any more groups; nobody consumes. A learner then takes half of the groups
into training without acking (those bytes stay held too). The broker's VmRSS (from /proc) is read when idle
and when full. Target: full RSS < bound + 150 MB. The JSON line's value is the full RSS, its reference the
bound + 150 MB (ratio < 1 meets the target).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import msgpack
import zmq

from bench import harness
from bench.broker_proc import start_broker
from bench.broker_throughput import GROUP_SIZE, group_record, group_tensors
from bench.harness import codec
from bench.report import report
from loraflow.common import framing
from loraflow.common.protocol import BatchRequest, Kind, LeaseRequest
from loraflow.common.transport import fetch_stats

REPO = Path(__file__).resolve().parent.parent
MB = 1 << 20


def reply(sock: zmq.Socket, timeout_s: float = 30.0) -> tuple[int, dict]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no reply from the broker")
    frames = sock.recv_multipart(copy=False)
    return framing.PREAMBLE.unpack(frames[0].buffer)[2], msgpack.unpackb(frames[1].buffer)


def fill(endpoint: str, group_bytes: int) -> int:
    """Submit groups until the broker grants no more leases; returns the number accepted."""
    ctx = zmq.Context()
    sock = harness.dealer(ctx, endpoint, "worker", "filler")
    tensors = group_tensors(group_bytes)
    accepted = 0
    while True:
        sock.send_multipart(codec.encode(LeaseRequest(max_leases=16, wait_ms=0)))
        kind, grant = reply(sock)
        assert kind == Kind.LEASE_GRANT, grant
        if not grant["leases"]:
            break
        for lease in grant["leases"]:
            record = group_record(lease["group_id"], lease["lease_id"], "filler", tensors)
            sock.send_multipart(codec.encode(record, tensors), copy=False)
            kind, answer = reply(sock)
            accepted += kind == Kind.ACK
    sock.close(linger=0)
    ctx.term()
    return accepted


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--bound-mb", type=int, default=256, help="broker.max_buffer_bytes in MB")
    parser.add_argument("--group-kb", type=int, default=1024, help="rollout group size in KB")
    args = harness.parse(parser, argv, bound_mb=16, group_kb=256)
    bound = args.bound_mb * MB
    with tempfile.TemporaryDirectory(prefix="bench-memory-", dir=REPO) as tmp:
        broker, endpoint = start_broker(Path(tmp), f"broker.max_buffer_bytes={bound}", "broker.capacity_groups=100000",
                                        "broker.max_leases_per_worker=100000", f"run.group_size={GROUP_SIZE}",
                                        "run.max_staleness=1000")
        try:
            idle = harness.rss_bytes(broker.pid)
            accepted = fill(endpoint, args.group_kb * 1024)
            ctx = zmq.Context()
            learner = harness.dealer(ctx, endpoint, "learner", "holder")
            learner.send_multipart(codec.encode(BatchRequest(num_groups=max(1, accepted // 2), wait_ms=0)))
            kind, batch = reply(learner)
            assert kind == Kind.BATCH and batch["groups"], "the learner got no batch"
            stats = fetch_stats(endpoint)
            held = stats["buffer"]["bytes"] + stats["buffer"]["training_bytes"]
            full = harness.rss_bytes(broker.pid)
            learner.close(linger=0)
            ctx.term()
        finally:
            broker.terminate()
            broker.wait(timeout=30)
    limit = bound + 150 * MB
    print(f"bound {bound / MB:.0f} MB; {accepted} groups of {args.group_kb} KB accepted, held {held / MB:.1f} MB "
          f"({stats['buffer']['groups']} buffered, {stats['buffer']['training_groups']} in training)")
    print(f"broker RSS idle {idle / MB:.1f} MB, full {full / MB:.1f} MB; allowed {limit / MB:.0f} MB "
          f"(bound + 150 MB): {'OK' if full < limit else 'OVER'}; RSS above idle {(full - idle) / MB:.1f} MB")
    report("broker_memory", "broker RSS with a full buffer", full / MB, "MB", limit / MB, bound_mb=args.bound_mb,
           held_mb=round(held / MB, 1), idle_mb=round(idle / MB, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
