"""The broker core's Python per group, in process, against another checkout of the broker (a before/after).

    .venv/bin/python -m bench.broker_core_cpu --reference-tree /path/to/other/checkout [--groups 4000]
        [--repeats 5] [--sizes 16384,262144]

One thread drives a :class:`loraflow.broker.core.BrokerCore` (no sockets) through every message a group costs the broker:
a LeaseRequest for 8 leases, the 8 RolloutGroups (validated, buffered, acknowledged), a BatchRequest served as a
Batch of 8, the BatchAck (settled, state written by the background writer with group commit, Ack released once
durable). The figure is the CPU time of that thread inside ``handle`` / ``tick`` / ``flush`` per group
(``time.thread_time``; encoding the clients' messages and waiting for the fsync are outside it): the broker
main thread's work per group, which is what bounds its throughput, and unlike the socket bench
(``bench/broker_throughput.py``) it does not move with what else the machine runs. The reference is the same
loop on ``--reference-tree`` (its ``broker`` package first on ``sys.path``, in a subprocess), interleaved run
by run; medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness
from bench.report import REPO, checkout_env, report

BATCH = 8


def child(num_groups: int, group_bytes: int) -> float:
    """Microseconds of core CPU per group in this process (the broker package on sys.path is the one measured)."""
    import msgpack

    from bench.broker_throughput import GROUP_SIZE, group_record, group_tensors
    from bench.harness import codec
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
        spent = 0.0
        replies: list = []

        def drive(identity: bytes, frames: list, wait_for: int | None = None) -> None:
            """Hand one message to the core and flush; with ``wait_for``, flush again (timed) each time the state
            writer has made its pending write durable (the wait itself untimed) until that reply is out."""
            nonlocal spent
            deadline = time.monotonic() + 30
            started = time.thread_time()
            core.handle(identity, frames, time.monotonic())
            while True:
                now = time.monotonic()
                core.tick(now)
                out = core.flush(now)
                replies.extend(out)
                spent += time.thread_time() - started
                if wait_for is None or any(o.kind == wait_for for o in out):
                    return
                writer = core.writer
                while writer.durable_seq < writer._seq:  # the fsync: not the core's CPU
                    assert time.monotonic() < deadline, "the state writer did not finish"
                    time.sleep(0.0002)
                started = time.thread_time()

        drive(worker, codec.encode(Hello(role="worker", client_id="w", session="s")))
        drive(learner, codec.encode(Hello(role="learner", client_id="l", session="s")), wait_for=Kind.WELCOME)
        spent, done = 0.0, 0
        while done < num_groups:
            replies.clear()
            drive(worker, codec.encode(LeaseRequest(max_leases=BATCH, adapter_version=0, wait_ms=0)))
            grant = msgpack.unpackb(next(o for o in replies if o.kind == Kind.LEASE_GRANT).frames[1])
            assert len(grant["leases"]) == BATCH, grant
            for lease in grant["leases"]:
                record = group_record(lease["group_id"], lease["lease_id"], "w", tensors)
                drive(worker, codec.encode(record, tensors))
            replies.clear()
            drive(learner, codec.encode(BatchRequest(num_groups=BATCH, wait_ms=0)))
            header = msgpack.unpackb(next(o for o in replies if o.kind == Kind.BATCH).frames[1])
            ids = [entry["group"]["group_id"] for entry in header["groups"]]
            drive(learner, codec.encode(BatchAck(batch_id=header["batch_id"], step=done // BATCH,
                                                    trained_version=0, group_ids=ids)), wait_for=Kind.ACK)
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
    """Where the core's CPU per group goes: each function of BREAKDOWN wrapped with a thread-CPU timer (in
    this process only) while :func:`child` runs; label -> microseconds per group (the wrappers' own cost, about
    a microsecond a call, is inside the figures)."""
    import functools
    import importlib

    spent: dict[str, float] = {}

    def timed(label: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
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
        wrapped = timed(label, original)
        setattr(owner, name, wrapped)
        if not path:  # a module-level function: modules that imported it by name hold their own reference
            for module in list(sys.modules.values()):
                if (module.__name__.startswith(("broker.", "common.")) and module is not owner
                        and getattr(module, name, None) is original):
                    setattr(module, name, wrapped)
    total = child(num_groups, group_bytes)
    return {"total": round(total, 1), **{label: round(spent.get(label, 0.0) / num_groups * 1e6, 1)
                                         for label, _, _ in BREAKDOWN}}


def run_child(tree: Path, num_groups: int, group_bytes: int) -> float:
    env = checkout_env(tree)
    out = subprocess.run([sys.executable, __file__, "--child", "--groups", str(num_groups), "--sizes",
                          str(group_bytes)], env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["us_per_group"]


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, repeats=5)
    parser.add_argument("--reference-tree", type=Path, help="another checkout of this repository (the reference)")
    parser.add_argument("--groups", type=int, default=4000, help="groups per run")
    parser.add_argument("--sizes", default="16384,262144", help="group sizes in bytes, comma-separated")
    parser.add_argument("--breakdown", action="store_true", help="this tree only: where its CPU per group goes, "
                        "by handler and step (each timed in-process)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # --quick: this tree against itself, a few hundred groups
    args = harness.parse(parser, argv, reference_tree=REPO, groups=200, repeats=1, sizes="16384")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child or args.breakdown:
        os.environ.setdefault("LORAFLOW_LOG_LEVEL", "warning")
        import logging

        logging.disable(logging.INFO)
        if args.child:
            print(json.dumps({"us_per_group": child(args.groups, sizes[0])}))
            return 0
        for size in sizes:
            parts = breakdown(args.groups, size)
            print(f"group {size // 1024} KB: {parts.pop('total')} us of core CPU per group (timers included)")
            for label, us in parts.items():
                print(f"  {label:<34} {us:7.1f} us")
        return 0
    if args.reference_tree is None:
        parser.error("--reference-tree is required")
    results: dict[int, dict[str, float]] = {}
    print(f"core CPU per group (us, main thread), {args.groups} groups per run, median of {args.repeats} "
          f"interleaved runs; this tree {REPO} vs reference {args.reference_tree}")
    for size in sizes:
        runs: dict[str, list[float]] = {"this": [], "reference": []}
        for _ in range(args.repeats):
            runs["reference"].append(run_child(args.reference_tree, args.groups, size))
            runs["this"].append(run_child(REPO, args.groups, size))
        results[size] = {k: round(statistics.median(v), 2) for k, v in runs.items()}
        print(f"group {size // 1024:5d} KB  this {results[size]['this']:7.1f} us  reference "
              f"{results[size]['reference']:7.1f} us  ratio {results[size]['this'] / results[size]['reference']:.3f}"
              f"   runs: this {[round(x, 1) for x in runs['this']]}  reference "
              f"{[round(x, 1) for x in runs['reference']]}")
    first = results[sizes[0]]
    report("broker_core_cpu", f"core CPU per group, {sizes[0] // 1024} KB groups", first["this"], "us",
           first["reference"], by_size={str(k): v for k, v in results.items()},
           ratio_by_size={str(k): round(v["this"] / v["reference"], 4) for k, v in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
