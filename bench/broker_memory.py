"""Broker memory with a full buffer: resident size against the configured byte bound (+ 150 MB allowed).

    .venv/bin/python -m bench.broker_memory [--bound-mb 256] [--group-kb 1024]

A worker fills a broker whose ``broker.max_buffer_bytes`` is ``--bound-mb`` (and whose group count is not the
limit) with ``--group-kb`` groups until it grants no more leases; a learner then takes half of them into training
without acking (those bytes stay held too). The JSON line's value is the broker's VmRSS when full, its reference
the bound + 150 MB (ratio < 1 meets the target).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import zmq

from bench import harness
from bench.harness import GROUP_SIZE, codec, group_record, group_tensors
from loraflow.common.protocol import BatchRequest, Kind, LeaseRequest
from loraflow.common.transport import fetch_stats

MB = 1 << 20


def reply(sock: zmq.Socket, timeout_s: float = 30.0) -> tuple[int, dict]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no reply from the broker")
    return harness.kind_and_header(sock.recv_multipart(copy=False))


def fill(sock: zmq.Socket, group_bytes: int) -> int:
    """Submit groups until the broker grants no more leases; the number accepted."""
    tensors, accepted = group_tensors(group_bytes), 0
    while True:
        sock.send_multipart(codec.encode(LeaseRequest(max_leases=16, wait_ms=0)))
        kind, grant = reply(sock)
        assert kind == Kind.LEASE_GRANT, grant
        if not grant["leases"]:
            return accepted
        for lease in grant["leases"]:
            sock.send_multipart(codec.encode(group_record(lease["group_id"], lease["lease_id"], "filler", tensors),
                                             tensors), copy=False)
            accepted += reply(sock)[0] == Kind.ACK


def main(argv: list[str] | None = None) -> int:
    parser = harness.flags(harness.parser(__doc__), {"bound_mb": (256, "broker.max_buffer_bytes in MB"),
                                                     "group_kb": (1024, "rollout group size in KB")})
    args = harness.parse(parser, argv, bound_mb=16, group_kb=256)
    bound, ctx = args.bound_mb * MB, zmq.Context()
    with tempfile.TemporaryDirectory(prefix="bench-memory-", dir=harness.REPO) as tmp:
        broker, endpoint = harness.start_broker(Path(tmp), f"broker.max_buffer_bytes={bound}",
                                                "broker.capacity_groups=100000", "broker.max_leases_per_worker=100000",
                                                f"run.group_size={GROUP_SIZE}", "run.max_staleness=1000")
        try:
            idle = harness.rss_bytes(broker.pid)
            accepted = fill(harness.dealer(ctx, endpoint, "worker", "filler"), args.group_kb * 1024)
            learner = harness.dealer(ctx, endpoint, "learner", "holder")
            learner.send_multipart(codec.encode(BatchRequest(num_groups=max(1, accepted // 2), wait_ms=0)))
            kind, batch = reply(learner)
            assert kind == Kind.BATCH and batch["groups"], "the learner got no batch"
            buffer = fetch_stats(endpoint)["buffer"]
            full = harness.rss_bytes(broker.pid)
        finally:
            ctx.destroy(linger=0)
            harness.reap([], broker)
    held, limit = buffer["bytes"] + buffer["training_bytes"], bound + 150 * MB
    harness.table(["bound", "group size", "held", "RSS idle", "RSS full", "allowed (bound + 150 MB)"], [[
        f"{args.bound_mb} MB", f"{args.group_kb} KB", f"{accepted} groups accepted, {held / MB:.1f} MB "
        f"({buffer['groups']} buffered, {buffer['training_groups']} in training)", f"{idle / MB:.1f} MB",
        f"{full / MB:.1f} MB ({'OK' if full < limit else 'OVER'})", f"{limit / MB:.0f} MB"]])
    harness.report("broker_memory", "broker RSS with a full buffer", full / MB, "MB", limit / MB, bound_mb=args.bound_mb,
                   held_mb=round(held / MB, 1), idle_mb=round(idle / MB, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
