"""Rollout-group throughput through the broker, next to a direct zmq pipe and a bare zmq.proxy relay.

    .venv/bin/python -m bench.broker_throughput [--producers 3] [--seconds 3] [--sizes 16384,262144,4194304]

Several producer processes push rollout groups (the real RolloutGroup message: preamble, msgpack header,
five tensor frames) to one consumer process, three ways, in the same run:

- direct: producers PUSH -> consumer PULL (the floor: one hop);
- relay:  producers PUSH -> ``zmq.proxy`` (PULL -> PUSH, its own process) -> consumer PULL: the cost of
  any hop;
- pyrelay: the same hop as a Python loop (``recv_multipart`` / ``send_multipart``, ``copy=False``, no logic): what
  a hop costs in Python before it does any work, so broker / pyrelay is the price of the broker's per-group work;
- broker: producers act as workers (LeaseRequest, RolloutGroup, Ack) and the consumer as the learner
  (BatchRequest, Batch, BatchAck) against ``python -m loraflow.broker``: leases, validation of every group (numpy
  views), dedup, buffering, batching and fsynced state writes (group commit);
- curve: the same with ``security.enabled``: every byte CURVE-encrypted (keys made once per run in the work
  directory, the producers holding a worker key, the consumer the learner key).

The figure is tensor payload bytes per second at the consumer, over ``--seconds`` after a warm-up. Every
socket's high-water mark is small so no mode can run ahead into unbounded queues. Next to it, each mode's CPU
per group summed over all its processes (producers, hop, consumer, in microseconds): on a machine whose cores
all these processes share, throughput goes as the inverse of that sum, so it says what a ratio target allows
the broker protocol to add per group. ``BENCH_CPU=1`` prints each run's CPU by process, the hop process's by
thread (main, zmq I/O, other) and how busy the whole machine was.

Targets: broker >= 0.8 x relay at 256 KB and 4 MB, >= 0.5 x at 16 KB. The JSON line's ratio is broker / relay at 256 KB; its
``curve_ratio`` is curve / broker at 256 KB (``curve_ratio_by_size`` for every size): the cost of encryption.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

from bench import harness
from bench.broker_proc import start_broker
from bench.harness import codec
from bench.report import report
from loraflow.common import framing
from loraflow.common.protocol import (
    AdapterFetch,
    AdapterUpdate,
    BatchAck,
    BatchRequest,
    Kind,
    LeaseRequest,
    RolloutGroup,
)
from loraflow.common.security import ClientSecurity, generate_keys

BENCH_KEYS = {"worker": "bench-worker", "learner": "bench-learner"}  # role -> key name (curve mode)
GROUP_SIZE = 8
PROMPT_LEN = 16
HWM = 8
WARMUP_S = 0.5
CHECKPOINT_EVERY = 20


def group_tensors(num_bytes: int) -> list[tuple[str, np.ndarray]]:
    """Five tensors of a GROUP_SIZE-sample group whose bytes add up to about ``num_bytes``."""
    prompt_bytes = GROUP_SIZE * PROMPT_LEN * 4
    completion_len = max(1, (num_bytes - prompt_bytes) // (13 * GROUP_SIZE))
    n = GROUP_SIZE * completion_len
    rng = np.random.default_rng(0)
    return [("prompt_ids", rng.integers(0, 200, GROUP_SIZE * PROMPT_LEN, dtype=np.int32)),
            ("completion_ids", rng.integers(0, 200, n, dtype=np.int32)),
            ("logprobs", np.full(n, -0.7, dtype=np.float32)),
            ("versions", np.zeros(n, dtype=np.int32)),
            ("loss_mask", np.ones(n, dtype=np.uint8))]


def group_record(group_id: str, lease_id: str, worker: str, tensors: list) -> RolloutGroup:
    completion_len = len(tensors[1][1]) // GROUP_SIZE
    return RolloutGroup(group_id=group_id, lease_id=lease_id, worker_id=worker, task="arith",
                        prompt_lens=[PROMPT_LEN] * GROUP_SIZE, completion_lens=[completion_len] * GROUP_SIZE,
                        rewards=[0.0] * GROUP_SIZE, finish_reasons=["stop"] * GROUP_SIZE, min_version=0,
                        max_version=0)


def payload_bytes(frames: list) -> int:
    return sum(len(f) for f in frames[2:])


# -- processes ---------------------------------------------------------------------------------------------


def push_producer(endpoint: str, num_bytes: int, stop: mp.Event) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.connect(endpoint)
    tensors = group_tensors(num_bytes)
    frames = codec.encode(group_record("0:0", "L", "p", tensors), tensors)
    while not stop.is_set():
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            sock.poll(50, zmq.POLLOUT)
    sock.close(linger=0)
    ctx.term()


def pull_consumer(endpoint: str | None, seconds: float, results: mp.Queue) -> None:
    """Connects to ``endpoint``, or binds a free port when None; puts its endpoint, then the rate."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if endpoint is None:
        sock.bind("tcp://127.0.0.1:*")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        sock.connect(endpoint)
    results.put(endpoint)
    frames = sock.recv_multipart(copy=False)
    start = time.perf_counter() + WARMUP_S
    while time.perf_counter() < start:
        frames = sock.recv_multipart(copy=False)
    total, end = 0, start + seconds
    while (now := time.perf_counter()) < end:
        frames = sock.recv_multipart(copy=False)
        total += payload_bytes(frames)
    results.put(total / (now - start))
    sock.close(linger=0)
    ctx.term()


def relay(endpoints: mp.Queue, in_python: bool = False) -> None:
    """A bare zmq.proxy (PULL -> PUSH) on two free ports, or the same hop as a Python loop; puts (frontend,
    backend)."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.bind("tcp://127.0.0.1:*")
    endpoints.put((pull.getsockopt_string(zmq.LAST_ENDPOINT), push.getsockopt_string(zmq.LAST_ENDPOINT)))
    if in_python:
        while True:
            push.send_multipart(pull.recv_multipart(copy=False), copy=False)
    zmq.proxy(pull, push)


def client_socket(endpoint: str, identity: bytes, keys_dir: str | None, hwm: int | None = None
                  ) -> tuple[zmq.Context, zmq.Socket]:
    """A DEALER to the broker, with the worker's or learner's CURVE keys when ``keys_dir`` is set."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
    if keys_dir is not None:
        ClientSecurity.load(keys_dir, BENCH_KEYS[identity.split(b"/")[0].decode()]).apply_client(sock)
    sock.connect(endpoint)
    return ctx, sock


def broker_worker(endpoint: str, num_bytes: int, max_leases: int, stop: mp.Event, keys_dir: str | None) -> None:
    """A lean rollout worker: long-polls for leases, submits a group per lease, and follows the learner's
    adapter versions as the real worker does (AdapterNotice -> AdapterFetch, one in flight; the version it
    holds goes into its LeaseRequests, so admission works as in a run)."""
    name = f"bench-{os.getpid()}"
    ctx, sock = client_socket(endpoint, f"worker/{name}".encode(), keys_dir, hwm=HWM)
    harness.hello(sock, "worker", name, batched_acks=True)  # as rollout_worker's client
    tensors = group_tensors(num_bytes)
    template = codec.encode(group_record("0:0", "L", name, tensors), tensors)
    header = msgpack.unpackb(template[1])
    packer = msgpack.Packer(use_bin_type=True)
    fetch = codec.encode(AdapterFetch(version=0))
    leases: list = []
    asking = fetching = False
    held = noticed = stamped = 0  # adapter version held; newest version announced; version the tokens carry
    while not stop.is_set():
        if not asking and len(leases) < max_leases // 2 + 1:
            sock.send_multipart(codec.encode(LeaseRequest(max_leases=max_leases - len(leases), adapter_version=held,
                                                             wait_ms=200)))
            asking = True
        if noticed > held and not fetching:
            sock.send_multipart(fetch)
            fetching = True
        if leases:
            lease = leases.pop()
            header["group_id"], header["lease_id"] = lease["group_id"], lease["lease_id"]
            if stamped != held:  # generated with the adapter now held: its tokens carry that version
                stamped = header["min_version"] = header["max_version"] = held
                template[2 + 3] = np.full(len(tensors[3][1]), held, dtype=np.int32)
            sock.send_multipart([template[0], packer.pack(header), *template[2:]], copy=False)
        elif not sock.poll(50):
            continue
        while True:  # everything that arrived, without waiting
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            kind = framing.PREAMBLE.unpack(frames[0].buffer)[2]
            if kind == Kind.LEASE_GRANT:
                grant = msgpack.unpackb(frames[1].buffer)
                leases.extend(grant["leases"])
                noticed = max(noticed, grant["latest_version"])
                asking = False
            elif kind == Kind.ADAPTER_NOTICE:
                noticed = max(noticed, msgpack.unpackb(frames[1].buffer)["version"])
            elif kind == Kind.ADAPTER_UPDATE:
                held = max(held, msgpack.unpackb(frames[1].buffer)["version"])
                fetching = False
            elif kind == Kind.ERROR:
                raise SystemExit(f"producer: broker error {msgpack.unpackb(frames[1].buffer)}")
    sock.close(linger=0)
    ctx.term()


def adapter_message(version: int) -> list:
    """A tiny AdapterUpdate (two 2 KB LoRA tensors, PEFT names) as the learner publishes after every step."""
    rng = np.random.default_rng(version)
    tensors = [(f"base_model.model.layers.0.q_proj.lora_{ab}.weight", rng.standard_normal(512, dtype=np.float32))
               for ab in "AB"]
    update = AdapterUpdate(version=version, step=version, sha256=framing.frames_sha256([t for _, t in tensors]),
                           adapter_config={"r": 8, "lora_alpha": 16, "peft_type": "LORA"})
    return codec.encode(update, tensors)


def end_step(sock: zmq.Socket, batch: dict, step: int, version: int, checkpoint_version: int) -> None:
    """What a learner sends after training ``batch`` (a Batch header): the tiny adapter of ``version``, then the
    BatchAck of the step (it trained ``version - 1``)."""
    sock.send_multipart(adapter_message(version), copy=False)
    sock.send_multipart(codec.encode(BatchAck(
        batch_id=batch["batch_id"], step=step, trained_version=version - 1,
        group_ids=[e["group"]["group_id"] for e in batch["groups"]], checkpoint_version=checkpoint_version)))


def broker_learner(endpoint: str, num_groups: int, prefetch: int, seconds: float, results: mp.Queue,
                   keys_dir: str | None) -> None:
    """A learner whose steps take no time: after every batch it publishes the next adapter version (a tiny one,
    as the real learner publishes every step) and acknowledges the batch, keeping ``prefetch`` requests out;
    its acks report a checkpoint every CHECKPOINT_EVERY steps (learner.checkpoint_every's default), which lets
    the broker forget the trained groups it keeps for a learner restart."""
    ctx, sock = client_socket(endpoint, b"learner/bench", keys_dir)
    harness.hello(sock, "learner", "bench")
    results.put(endpoint)
    version = checkpoint_version = 0
    for _ in range(prefetch):  # batches requested ahead, as a learner that prefetches
        sock.send_multipart(codec.encode(BatchRequest(num_groups=num_groups, wait_ms=1000)))
    start = end = None
    total, step = 0, 0
    trace: dict[int, int] | None = {} if os.environ.get("BENCH_TRACE") else None  # second -> bytes
    while True:
        frames = sock.recv_multipart(copy=False)
        kind, batch = harness.kind_and_header(frames)
        if kind == Kind.ACK:
            continue
        if kind != Kind.BATCH:
            raise SystemExit(f"learner: unexpected {kind} {batch}")
        now = time.perf_counter()
        if start is None:
            start, end = now + WARMUP_S, now + WARMUP_S + seconds
        if now >= end:
            break
        if batch["groups"]:
            step += 1
            if now >= start:
                total += payload_bytes(frames)
                if trace is not None:
                    trace[int(now - start)] = trace.get(int(now - start), 0) + payload_bytes(frames)
            version += 1  # the step trained version - 1 and publishes version
            if step % CHECKPOINT_EVERY == 0:
                checkpoint_version = version
            end_step(sock, batch, step, version, checkpoint_version)
        sock.send_multipart(codec.encode(BatchRequest(num_groups=num_groups, wait_ms=1000,
                                                         learner_version=version)))
    if trace is not None:
        print("  learner MB/s per second: " + " ".join(f"{trace.get(i, 0) / 1e6:.0f}" for i in range(int(seconds))),
              flush=True)
    results.put(total / (now - start))
    sock.close(linger=0)
    ctx.term()


# -- modes -------------------------------------------------------------------------------------------------


def bench_keys(workdir: Path) -> str:
    """CURVE keys for the curve mode (made once per work directory): the broker's, a worker's, the learner's."""
    keys = workdir / "keys"
    if not (keys / "broker.key_secret").is_file():
        generate_keys(keys, {BENCH_KEYS["worker"]: "worker", BENCH_KEYS["learner"]: "learner"})
    return str(keys)


def run_mode(mode: str, num_bytes: int, producers: int, seconds: float, workdir: Path,
             batch_bytes: int = 4 << 20, capacity_batches: int = 4, prefetch: int = 2) -> tuple[float, dict[str, float]]:
    """(payload bytes/s at the consumer, CPU share (cores) of the hop process, the consumer and the producers;
    the hop's is 0 for direct)."""
    spawn = mp.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    children: list = []
    producers_: list = []
    broker = None
    hop_pid = None
    try:
        if mode == "direct":
            consumer = spawn.Process(target=pull_consumer, args=(None, seconds, results))
            consumer.start()
            endpoint = results.get(timeout=30)
            producers_ = [spawn.Process(target=push_producer, args=(endpoint, num_bytes, stop))
                          for _ in range(producers)]
        elif mode in ("relay", "pyrelay"):
            proxy = spawn.Process(target=relay, args=(results, mode == "pyrelay"), daemon=True)
            proxy.start()
            children.append(proxy)
            hop_pid = proxy.pid
            front, back = results.get(timeout=30)
            consumer = spawn.Process(target=pull_consumer, args=(back, seconds, results))
            consumer.start()
            results.get(timeout=30)
            producers_ = [spawn.Process(target=push_producer, args=(front, num_bytes, stop))
                          for _ in range(producers)]
        else:
            num_groups = int(min(64, max(2, batch_bytes // num_bytes)))
            capacity = max(capacity_batches * num_groups, producers * 8)
            shutil.rmtree(workdir / "run", ignore_errors=True)  # a fresh broker each run (no restored state)
            keys_dir = bench_keys(workdir) if mode == "curve" else None
            security = ["security.enabled=true", f"security.keys_dir=\"{keys_dir}\""] if keys_dir else []
            profile = ("-m", "cProfile", "-o", os.environ["BENCH_PROFILE"]) if os.environ.get("BENCH_PROFILE") else ()
            broker, endpoint = start_broker(workdir, f"run.group_size={GROUP_SIZE}", f"run.groups_per_step={num_groups}",
                                            "run.max_staleness=1000", f"broker.capacity_groups={capacity}",
                                            f"broker.max_leases_per_worker={capacity}", *security,
                                            python_args=profile)
            hop_pid = broker.pid
            consumer = spawn.Process(target=broker_learner,
                                     args=(endpoint, num_groups, prefetch, seconds, results, keys_dir))
            consumer.start()
            results.get(timeout=30)
            per_worker = max(2, capacity // producers)
            producers_ = [spawn.Process(target=broker_worker, args=(endpoint, num_bytes, per_worker, stop, keys_dir))
                          for _ in range(producers)]
        for child in producers_:
            child.start()
        children += producers_
        pids = {"hop": [hop_pid] if hop_pid else [], "consumer": [consumer.pid], "producers": [p.pid for p in producers_]}
        started = time.perf_counter()
        before = {k: sum(harness.cpu_seconds(p) for p in v) for k, v in pids.items()}
        threads_before = harness.thread_cpu(hop_pid) if hop_pid else {}
        machine_before = harness.machine_busy_ticks()
        value = results.get(timeout=seconds + 60)
        elapsed = time.perf_counter() - started
        shares = {k: (sum(harness.cpu_seconds(p) for p in v) - before[k]) / elapsed for k, v in pids.items()}
        threads = {k: (v - threads_before[k]) / elapsed for k, v in harness.thread_cpu(hop_pid).items()} if hop_pid else {}
        busy_now, total_now = harness.machine_busy_ticks()
        machine_busy = (busy_now - machine_before[0]) / max(1, total_now - machine_before[1])
        if os.environ.get("BENCH_CPU"):
            per_gb = {k: v / max(value, 1.0) * 1e9 for k, v in shares.items()}  # CPU s per GB moved (approx.)
            print(f"  {mode} {num_bytes}: {value / 1e6:.0f} MB/s cpu " + " ".join(f"{k} {v:.0%}" for k, v in shares.items())
                  + "  cpu s/GB " + " ".join(f"{k} {v:.2f}" for k, v in per_gb.items())
                  + f" total {sum(per_gb.values()):.2f}  hop threads " + " ".join(f"{k} {v:.0%}" for k, v in threads.items())
                  + f"  machine busy {machine_busy:.0%}", flush=True)
        consumer.join(timeout=10)
        return value, shares
    finally:
        stop.set()
        harness.reap(children, broker, timeout_s=5)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, repeats=3, seconds=3.0)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--sizes", default="16384,262144,4194304", help="group sizes in bytes, comma-separated")
    parser.add_argument("--modes", default="direct,relay,pyrelay,broker,curve")
    parser.add_argument("--batch-bytes", type=int, default=4 << 20, help="broker mode: bytes per learner batch "
                        "(groups per batch = this / group size, 2..64)")
    parser.add_argument("--capacity-batches", type=int, default=4, help="broker mode: capacity_groups in batches")
    parser.add_argument("--prefetch", type=int, default=2, help="broker mode: batch requests kept outstanding")
    args = harness.parse(parser, argv, producers=2, seconds=0.3, repeats=1, sizes="262144",
                         modes="relay,broker,curve")
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    results: dict[int, dict[str, float]] = {}
    cpu: dict[int, dict[str, float]] = {}
    cpu_per_group: dict[int, dict[str, float]] = {}  # microseconds of CPU, all processes of a mode
    print(f"{args.producers} producers, {args.seconds:g} s per run, median of {args.repeats} interleaved runs; "
          "payload MB/s at the consumer (CPU share of the hop process)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-broker-", dir=Path(__file__).resolve().parent.parent) as tmp:
        for size in sizes:
            runs: dict[str, list[tuple[float, dict[str, float]]]] = {m: [] for m in modes}
            for _ in range(args.repeats):
                for mode in modes:
                    runs[mode].append(run_mode(mode, size, args.producers, args.seconds, Path(tmp),
                                               args.batch_bytes, args.capacity_batches, args.prefetch))
            results[size] = {m: statistics.median(r[0] for r in runs[m]) for m in modes}
            cpu[size] = {m: statistics.median(r[1]["hop"] for r in runs[m]) for m in modes}
            cpu_per_group[size] = {m: statistics.median(sum(r[1].values()) / max(r[0] / size, 1e-9) * 1e6
                                                        for r in runs[m]) for m in modes}
            row = results[size]
            cells = "  ".join(f"{m} {row[m] / 1e6:7.1f}" + (f" ({cpu[size][m]:.0%})" if m != "direct" else "")
                              for m in modes)
            ratios = "  ".join(f"{m}/relay {row[m] / row['relay']:.2f}" for m in modes
                               if m != "relay" and "relay" in row)
            if "curve" in row and "broker" in row:
                ratios += f"  curve/broker {row['curve'] / row['broker']:.2f}"
            spread = "  ".join(f"{m} [{min(r[0] for r in runs[m]) / 1e6:.0f}-{max(r[0] for r in runs[m]) / 1e6:.0f}]"
                               for m in modes)
            print(f"group {size / 1024:>6.0f} KB  {cells}   {ratios}   runs: {spread}", flush=True)
            print(" " * 17 + "CPU per group, all processes: "
                  + "  ".join(f"{m} {cpu_per_group[size][m]:.0f} us" for m in modes), flush=True)
    key = 262144 if 262144 in results else sizes[0]
    row = results[key]
    report("broker_throughput", f"broker throughput, {key // 1024} KB groups", row.get("broker", 0.0) / 1e6, "MB/s",
           row.get("relay", 0.0) / 1e6, producers=args.producers,
           by_size={str(s): {m: round(v / 1e6, 1) for m, v in r.items()} for s, r in results.items()},
           ratio_by_size={str(s): round(r["broker"] / r["relay"], 3) for s, r in results.items()
                          if "broker" in r and "relay" in r},
           curve_ratio=round(row["curve"] / row["broker"], 3) if "curve" in row and "broker" in row else None,
           curve_ratio_by_size={str(s): round(r["curve"] / r["broker"], 3) for s, r in results.items()
                                if "curve" in r and "broker" in r},
           cpu_us_per_group_by_size={str(s): {m: round(v) for m, v in r.items()} for s, r in cpu_per_group.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
