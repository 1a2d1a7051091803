"""The broker core's Python per group, in process, against another checkout of the broker (a before/after).

    .venv/bin/python -m bench.broker_core_cpu --reference-tree DIR [--groups 4000] [--repeats 5] [--sizes 16384,262144]
    .venv/bin/python -m bench.broker_core_cpu --breakdown [--groups 3000]     # this tree, by handler and step

One thread drives a ``BrokerCore`` (no sockets) through what a group costs the broker: a LeaseRequest for 8, the
8 RolloutGroups, a BatchRequest served as a Batch of 8, the BatchAck (the Ack released once the state write is
durable). The figure is that thread's CPU inside ``handle`` / ``tick`` / ``flush`` per group (the clients' encoding
and the fsync wait outside it): the work that bounds the broker's throughput, hardly moved by the machine's load.
Each tree runs in a subprocess with its own code, interleaved run by run; medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import REPO

BATCH = 8


def child(num_groups: int, group_bytes: int) -> float:
    """Microseconds of core CPU per group in this process (the installed broker is the one measured)."""
    import msgpack

    from bench.harness import GROUP_SIZE, codec, group_record, group_tensors
    from loraflow.broker.core import BrokerCore
    from loraflow.common.config import load_config
    from loraflow.common.protocol import BatchAck, BatchRequest, Hello, Kind, LeaseRequest
    from loraflow.common.tasks import load_task

    worker, learner = b"worker/w", b"learner/l"
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, [f"run.group_size={GROUP_SIZE}", f"run.groups_per_step={BATCH}",
                                    "run.max_staleness=1000", f"broker.capacity_groups={4 * BATCH}",
                                    f"broker.max_leases_per_worker={BATCH}", f"run.run_dir={tmp}",
                                    f"broker.max_buffer_bytes={64 * BATCH * (group_bytes + (64 << 10))}"])
        core = BrokerCore(config, task=load_task(config.run.task, config.run.seed), vocab_size=200,
                          state_path=Path(tmp) / "state.json")
        tensors = group_tensors(group_bytes)
        spent, replies = 0.0, []

        def drive(identity: bytes, frames: list, wait_for: int | None = None) -> None:
            """Hand one message to the core and flush; with ``wait_for``, flush again (timed) each time the state
            writer made its pending write durable (the wait untimed) until that reply is out."""
            nonlocal spent
            deadline, started = time.monotonic() + 30, time.thread_time()
            core.handle(identity, frames, time.monotonic())
            while True:
                now = time.monotonic()
                core.tick(now)
                out = core.flush(now)
                replies.extend(out)
                spent += time.thread_time() - started
                if wait_for is None or any(o.kind == wait_for for o in out):
                    return
                while core.writer.durable_seq < core.writer._seq:  # the fsync: not the core's CPU
                    assert time.monotonic() < deadline, "the state writer did not finish"
                    time.sleep(0.0002)
                started = time.thread_time()

        def reply(kind: int) -> dict:
            return msgpack.unpackb(next(o for o in replies if o.kind == kind).frames[1])

        drive(worker, codec.encode(Hello(role="worker", client_id="w", session="s")))
        drive(learner, codec.encode(Hello(role="learner", client_id="l", session="s")), wait_for=Kind.WELCOME)
        spent, done = 0.0, 0
        while done < num_groups:
            replies.clear()
            drive(worker, codec.encode(LeaseRequest(max_leases=BATCH, adapter_version=0, wait_ms=0)))
            grant = reply(Kind.LEASE_GRANT)
            assert len(grant["leases"]) == BATCH, grant
            for lease in grant["leases"]:
                drive(worker, codec.encode(group_record(lease["group_id"], lease["lease_id"], "w", tensors), tensors))
            replies.clear()
            drive(learner, codec.encode(BatchRequest(num_groups=BATCH, wait_ms=0)))
            header = reply(Kind.BATCH)
            drive(learner, codec.encode(BatchAck(batch_id=header["batch_id"], step=done // BATCH, trained_version=0,
                                                 group_ids=[e["group"]["group_id"] for e in header["groups"]])),
                  wait_for=Kind.ACK)
            done += BATCH
        core.drain(time.monotonic())
        return spent / done * 1e6


#: (label, module, attribute) timed by --breakdown; indented labels are parts of the one above them
BREAKDOWN = (
    ("RolloutGroup handler", "loraflow.broker.core", "BrokerCore._on_rollout_group"),
    ("  judge (loraflow.broker.groups)", "loraflow.broker.groups", "judge"),
    ("    tensor value checks", "loraflow.common.group_checks", "check_group_values"),
    ("    lease MAC check", "loraflow.broker.prompts", "LeaseTable.issued_to"),
    ("  ledger accept", "loraflow.broker.ledger", "GroupLedger.accept"),
    ("  stored group", "loraflow.broker.groups", "stored"),
    ("envelope decode (all kinds)", harness.codec.__name__, "decode_envelope"),
    ("record decode (all kinds)", harness.codec.__name__, "decode_record"),
    ("LeaseRequest handler", "loraflow.broker.core", "BrokerCore._on_lease_request"),
    ("  prompt items (task)", "loraflow.broker.prompts", "PromptSource.item"),
    ("  lease grants + MAC", "loraflow.broker.prompts", "LeaseTable.grant"),
    ("BatchRequest handler", "loraflow.broker.core", "BrokerCore._on_batch_request"),
    ("BatchAck handler", "loraflow.broker.core", "BrokerCore._on_batch_ack"),
    ("flush (replies, state hand-off)", "loraflow.broker.core", "BrokerCore.flush"),
    ("  state snapshot", "loraflow.broker.restore", "state_of"),
    ("tick", "loraflow.broker.core", "BrokerCore.tick"),
)


def breakdown(num_groups: int, group_bytes: int) -> dict[str, float]:
    """Label -> microseconds per group of each BREAKDOWN function, wrapped with a thread-CPU timer while
    :func:`child` runs (the wrappers' own ~1 us a call is inside the figures)."""
    spent: dict[str, float] = {}

    def timed(label: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - started
        return wrapper

    for label, module_name, attribute in BREAKDOWN:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        setattr(owner, name, wrapped := timed(label, original))
        if not path:  # a module-level function: modules that imported it by name hold their own reference
            for module in list(sys.modules.values()):
                if module.__name__.startswith("loraflow.") and getattr(module, name, None) is original:
                    setattr(module, name, wrapped)
    total = child(num_groups, group_bytes)
    return {"total": round(total, 1), **{label: round(spent.get(label, 0.0) / num_groups * 1e6, 1)
                                         for label, _, _ in BREAKDOWN}}


def run_child(tree: Path, num_groups: int, group_bytes: int) -> float:
    argv = ["-m", "bench.broker_core_cpu", "--child", "--groups", str(num_groups), "--sizes", str(group_bytes)]
    return harness.in_tree(argv, tree)["us_per_group"]


def main(argv: list[str] | None = None) -> int:
    parser = harness.flags(harness.parser(__doc__, repeats=5), {
        "groups": (4000, "groups per run"), "sizes": ("16384,262144", "group sizes in bytes, comma-separated")})
    parser.add_argument("--reference-tree", type=Path, help="another checkout of this repository (the reference)")
    parser.add_argument("--breakdown", action="store_true", help="this tree only: its CPU per group by handler/step")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # --quick: this tree against itself, a few hundred groups
    args = harness.parse(parser, argv, reference_tree=REPO, groups=200, repeats=1, sizes="16384")
    sizes = harness.sizes(args.sizes)
    if args.child or args.breakdown:
        os.environ.setdefault("LORAFLOW_LOG_LEVEL", "warning")
        logging.disable(logging.INFO)
        if args.child:
            print(json.dumps({"us_per_group": child(args.groups, sizes[0])}))
        for size in sizes if args.breakdown else ():
            parts = breakdown(args.groups, size)
            print(f"group {size // 1024} KB: {parts.pop('total')} us of core CPU per group (timers included)")
            harness.table(["step", "us per group"], parts.items())
        return 0
    if args.reference_tree is None:
        parser.error("--reference-tree is required")
    results: dict[int, dict[str, float]] = {}
    rows = []
    for size in sizes:
        runs = harness.interleave({name: lambda tree=tree, size=size: run_child(tree, args.groups, size)
                                   for name, tree in (("reference", args.reference_tree), ("this", REPO))}, args.repeats)
        r = results[size] = {k: round(harness.median(v), 2) for k, v in runs.items()}
        spread = " / ".join(f"{min(runs[k]):.0f}-{max(runs[k]):.0f}" for k in ("this", "reference"))
        rows.append([f"{size // 1024} KB", f"{r['this']:.1f} us", f"{r['reference']:.1f} us",
                     f"{r['this'] / r['reference']:.3f}", spread])
    print(f"core CPU per group (main thread), {args.groups} groups per run, median of {args.repeats} interleaved runs; "
          f"this tree {REPO} vs reference {args.reference_tree}")
    harness.table(["group", "this", "reference", "this / reference", "runs this / reference"], rows)
    first = results[sizes[0]]
    harness.report("broker_core_cpu", f"core CPU per group, {sizes[0] // 1024} KB groups", first["this"], "us",
                   first["reference"], by_size={str(k): v for k, v in results.items()},
                   ratio_by_size={str(k): round(v["this"] / v["reference"], 4) for k, v in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
