"""Rollout-group throughput through the broker, next to a direct zmq pipe and a bare zmq.proxy relay.

    .venv/bin/python -m bench.broker_throughput [--producers 3] [--seconds 3] [--sizes 16384,262144,4194304]

Producers send real RolloutGroups to one consumer: direct (PUSH -> PULL), relay (through ``zmq.proxy``, the cost
of any hop), pyrelay (the hop as a Python loop), broker (raw workers and a learner whose steps take no time, each
step publishing a tiny adapter, against ``python -m loraflow.broker``), curve (the same with CURVE on). The
figure is tensor bytes/s at the consumer after a warm-up, small high-water marks everywhere, with each mode's CPU
per group over all its processes; ``BENCH_CPU=1`` prints each run's CPU by process and the hop's by thread.
Targets: broker >= 0.8 x relay at 256 KB and 4 MB, >= 0.5 x at 16 KB. The JSON line's ratio is broker / relay
at 256 KB, ``curve_ratio`` curve / broker there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

from bench import harness
from bench.harness import GROUP_SIZE, codec, group_record, group_tensors
from loraflow.common import framing
from loraflow.common.protocol import AdapterFetch, AdapterUpdate, BatchAck, BatchRequest, Kind, LeaseRequest
from loraflow.common.security import ClientSecurity, generate_keys

BENCH_KEYS = {"worker": "bench-worker", "learner": "bench-learner"}  # role -> key name (curve mode)
HWM = 8
WARMUP_S = 0.5
CHECKPOINT_EVERY = 20  # learner.checkpoint_every's default: lets the broker forget trained groups


def payload_bytes(frames: list) -> int:
    return sum(len(f) for f in frames[2:])


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
    ctx.destroy(linger=0)


def pull_consumer(endpoint: str | None, seconds: float, results: mp.Queue) -> None:
    """Connects to ``endpoint`` (or binds a free port when None); puts its endpoint, then the payload rate."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if endpoint is None:
        sock.bind("tcp://127.0.0.1:*")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        sock.connect(endpoint)
    results.put(endpoint)
    sock.recv_multipart(copy=False)
    start = time.perf_counter() + WARMUP_S
    while time.perf_counter() < start:
        sock.recv_multipart(copy=False)
    total, end = 0, start + seconds
    while (now := time.perf_counter()) < end:
        total += payload_bytes(sock.recv_multipart(copy=False))
    results.put(total / (now - start))
    ctx.destroy(linger=0)


def relay(endpoints: mp.Queue, in_python: bool = False) -> None:
    """A bare zmq.proxy (PULL -> PUSH) on two free ports, or the same hop as a Python loop; puts both ends."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.bind("tcp://127.0.0.1:*")
    endpoints.put((pull.getsockopt_string(zmq.LAST_ENDPOINT), push.getsockopt_string(zmq.LAST_ENDPOINT)))
    while in_python:
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
    """A lean rollout worker: long-polls for leases, submits a group per lease, and follows the learner's adapter
    versions as the real one does (AdapterNotice -> AdapterFetch, one in flight; the version held goes into its
    LeaseRequests and its tokens, so admission works as in a run)."""
    name = f"bench-{os.getpid()}"
    ctx, sock = client_socket(endpoint, f"worker/{name}".encode(), keys_dir, hwm=HWM)
    harness.hello(sock, "worker", name, batched_acks=True)
    tensors = group_tensors(num_bytes)
    template = codec.encode(group_record("0:0", "L", name, tensors), tensors)
    header = msgpack.unpackb(template[1])
    packer = msgpack.Packer(use_bin_type=True)
    fetch = codec.encode(AdapterFetch(version=0))
    leases: list = []
    asking = fetching = False
    held = noticed = stamped = 0  # adapter version held; newest announced; the version the tokens carry
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
            if stamped != held:
                stamped = header["min_version"] = header["max_version"] = held
                template[2 + 3] = np.full(len(tensors[3][1]), held, dtype=np.int32)
            sock.send_multipart([template[0], packer.pack(header), *template[2:]], copy=False)
        elif not sock.poll(50):
            continue
        while sock.poll(0):  # everything that arrived, without waiting
            kind, body = harness.kind_and_header(sock.recv_multipart(copy=False))
            if kind == Kind.LEASE_GRANT:
                leases.extend(body["leases"])
                noticed, asking = max(noticed, body["latest_version"]), False
            elif kind == Kind.ADAPTER_NOTICE:
                noticed = max(noticed, body["version"])
            elif kind == Kind.ADAPTER_UPDATE:
                held, fetching = max(held, body["version"]), False
            elif kind == Kind.ERROR:
                raise SystemExit(f"producer: broker error {body}")
    ctx.destroy(linger=0)


def adapter_message(version: int) -> list:
    """A tiny AdapterUpdate (two 2 KB LoRA tensors) as the learner publishes after every step."""
    rng = np.random.default_rng(version)
    tensors = [(f"base_model.model.layers.0.q_proj.lora_{ab}.weight", rng.standard_normal(512, dtype=np.float32))
               for ab in "AB"]
    return codec.encode(AdapterUpdate(version=version, step=version,
                                      sha256=framing.frames_sha256([t for _, t in tensors]),
                                      adapter_config={"r": 8, "lora_alpha": 16, "peft_type": "LORA"}), tensors)


def end_step(sock: zmq.Socket, batch: dict, step: int, version: int, checkpoint_version: int) -> None:
    """What a learner sends after training ``batch``: the tiny adapter of ``version``, then the step's BatchAck."""
    sock.send_multipart(adapter_message(version), copy=False)
    sock.send_multipart(codec.encode(BatchAck(
        batch_id=batch["batch_id"], step=step, trained_version=version - 1,
        group_ids=[e["group"]["group_id"] for e in batch["groups"]], checkpoint_version=checkpoint_version)))


def broker_learner(endpoint: str, num_groups: int, prefetch: int, seconds: float, results: mp.Queue,
                   keys_dir: str | None) -> None:
    """A learner whose steps take no time: per batch it publishes the next version and acks, ``prefetch``
    requests kept out, a checkpoint reported every CHECKPOINT_EVERY steps; puts its endpoint, then the rate."""
    ctx, sock = client_socket(endpoint, b"learner/bench", keys_dir)
    harness.hello(sock, "learner", "bench")
    results.put(endpoint)
    for _ in range(prefetch):
        sock.send_multipart(codec.encode(BatchRequest(num_groups=num_groups, wait_ms=1000)))
    start = end = None
    total = step = version = checkpoint_version = 0
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
            total += payload_bytes(frames) if now >= start else 0
            version += 1  # the step trained version - 1 and publishes version
            checkpoint_version = version if step % CHECKPOINT_EVERY == 0 else checkpoint_version
            end_step(sock, batch, step, version, checkpoint_version)
        sock.send_multipart(codec.encode(BatchRequest(num_groups=num_groups, wait_ms=1000, learner_version=version)))
    results.put(total / (now - start))
    ctx.destroy(linger=0)


def run_mode(mode: str, num_bytes: int, args, workdir: Path) -> tuple[float, dict[str, float]]:
    """(payload bytes/s at the consumer, CPU share (cores) of the hop process, the consumer and the producers)."""
    spawn = mp.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    children, broker, hop_pid, front, back = [], None, None, None, None
    try:
        if mode in ("relay", "pyrelay"):
            children.append(harness.spawn(relay, results, mode == "pyrelay"))
            hop_pid = children[0].pid
            front, back = results.get(timeout=30)
        if mode in ("direct", "relay", "pyrelay"):
            consumer = harness.spawn(pull_consumer, back, args.seconds, results, daemon=False)
            front = front or results.get(timeout=30)
            if hop_pid:
                results.get(timeout=30)  # the consumer is connected
            producers = [(push_producer, front, num_bytes, stop)] * args.producers
        else:
            num_groups = int(min(64, max(2, args.batch_bytes // num_bytes)))
            capacity = max(args.capacity_batches * num_groups, args.producers * 8)
            shutil.rmtree(workdir / "run", ignore_errors=True)  # a fresh broker each run (no restored state)
            keys = workdir / "keys"
            if mode == "curve" and not (keys / "broker.key_secret").is_file():
                generate_keys(keys, {BENCH_KEYS["worker"]: "worker", BENCH_KEYS["learner"]: "learner"})
            keys_dir = str(keys) if mode == "curve" else None
            security = ["security.enabled=true", f"security.keys_dir=\"{keys_dir}\""] if keys_dir else []
            broker, endpoint = harness.start_broker(
                workdir, f"run.group_size={GROUP_SIZE}", f"run.groups_per_step={num_groups}", "run.max_staleness=1000",
                f"broker.capacity_groups={capacity}", f"broker.max_leases_per_worker={capacity}", *security)
            hop_pid = broker.pid
            consumer = harness.spawn(broker_learner, endpoint, num_groups, args.prefetch, args.seconds, results,
                                     keys_dir, daemon=False)
            results.get(timeout=30)
            producers = [(broker_worker, endpoint, num_bytes, max(2, capacity // args.producers), stop, keys_dir)
                         ] * args.producers
        children += [harness.spawn(*p, daemon=False) for p in producers]
        pids = {"hop": [hop_pid] if hop_pid else [], "consumer": [consumer.pid],
                "producers": [c.pid for c in children[-args.producers:]]}
        started = time.perf_counter()
        before = {k: sum(harness.cpu_seconds(p) for p in v) for k, v in pids.items()}
        threads_before = harness.thread_cpu(hop_pid) if hop_pid else {}
        machine_before = harness.machine_busy_ticks()
        value = results.get(timeout=args.seconds + 60)
        elapsed = time.perf_counter() - started
        shares = {k: (sum(harness.cpu_seconds(p) for p in v) - before[k]) / elapsed for k, v in pids.items()}
        if os.environ.get("BENCH_CPU"):
            threads = {k: (v - threads_before[k]) / elapsed for k, v in harness.thread_cpu(hop_pid).items()} \
                if hop_pid else {}
            busy, total = (now - then for now, then in zip(harness.machine_busy_ticks(), machine_before, strict=True))
            per_gb = {k: v / max(value, 1.0) * 1e9 for k, v in shares.items()}  # CPU s per GB moved (approx.)
            print(f"  {mode} {num_bytes}: {value / 1e6:.0f} MB/s cpu " + " ".join(f"{k} {v:.0%}" for k, v in shares.items())
                  + "  cpu s/GB " + " ".join(f"{k} {v:.2f}" for k, v in per_gb.items())
                  + f" total {sum(per_gb.values()):.2f}  hop threads " + " ".join(f"{k} {v:.0%}" for k, v in threads.items())
                  + f"  machine busy {busy / max(1, total):.0%}", flush=True)
        consumer.join(timeout=10)
        return value, shares
    finally:
        stop.set()
        harness.reap(children, broker, timeout_s=5)


def main(argv: list[str] | None = None) -> int:
    parser = harness.flags(harness.parser(__doc__, repeats=3, seconds=3.0), {
        "producers": 3, "sizes": ("16384,262144,4194304", "group sizes in bytes, comma-separated"),
        "modes": "direct,relay,pyrelay,broker,curve", "prefetch": (2, "broker mode: batch requests kept outstanding"),
        "batch_bytes": (4 << 20, "broker mode: bytes per learner batch (groups per batch: this / group size, 2..64)"),
        "capacity_batches": (4, "broker mode: capacity_groups in batches")})
    args = harness.parse(parser, argv, producers=2, seconds=0.3, repeats=1, sizes="262144", modes="relay,broker,curve")
    modes = args.modes.split(",")
    rates: dict[int, dict[str, float]] = {}
    cpu: dict[int, dict[str, float]] = {}  # microseconds of CPU per group, all processes of a mode
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-broker-", dir=harness.REPO) as tmp:
        for size in harness.sizes(args.sizes):
            runs = harness.interleave({m: lambda m=m, size=size: run_mode(m, size, args, Path(tmp)) for m in modes}, args.repeats)
            rate = rates[size] = {m: harness.median(v for v, _ in runs[m]) for m in modes}
            hop = {m: harness.median(s["hop"] for _, s in runs[m]) for m in modes}
            cpu[size] = {m: harness.median(sum(s.values()) / max(v / size, 1e-9) * 1e6 for v, s in runs[m]) for m in modes}
            ratios = {f"{m} / relay": rate[m] / rate["relay"] for m in modes if m != "relay" and "relay" in rate}
            if "curve" in rate and "broker" in rate:
                ratios["curve / broker"] = rate["curve"] / rate["broker"]
            rows.append([f"{size // 1024} KB", *(f"{rate[m] / 1e6:.0f} MB/s ({hop[m]:.0%}) "
                                                  f"[{min(v for v, _ in runs[m]) / 1e6:.0f}-{max(v for v, _ in runs[m]) / 1e6:.0f}]"
                                                  for m in modes), " ".join(f"{k} {v:.2f}" for k, v in ratios.items())])
            print(f"group {size // 1024} KB done", flush=True)
    print(f"{args.producers} producers, {args.seconds:g} s per run, median of {args.repeats} interleaved runs; payload "
          "MB/s at the consumer (CPU share of the hop process) [range of runs]")
    harness.table(["group", *modes, "ratios"], rows)
    print("CPU per group, all processes of a mode:")
    harness.table(["group", *modes], ([f"{s // 1024} KB", *(f"{us[m]:.0f} us" for m in modes)] for s, us in cpu.items()))
    key = 262144 if 262144 in rates else min(rates)
    row = rates[key]
    both = {s: r for s, r in rates.items() if "curve" in r and "broker" in r}
    harness.report("broker_throughput", f"broker throughput, {key // 1024} KB groups", row.get("broker", 0.0) / 1e6,
                   "MB/s", row.get("relay", 0.0) / 1e6, producers=args.producers,
                   by_size={str(s): {m: round(v / 1e6, 1) for m, v in r.items()} for s, r in rates.items()},
                   ratio_by_size={str(s): round(r["broker"] / r["relay"], 3) for s, r in rates.items()
                                  if "broker" in r and "relay" in r},
                   curve_ratio=round(row["curve"] / row["broker"], 3) if key in both else None,
                   curve_ratio_by_size={str(s): round(r["curve"] / r["broker"], 3) for s, r in both.items()},
                   cpu_us_per_group_by_size={str(s): {m: round(v) for m, v in r.items()} for s, r in cpu.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
