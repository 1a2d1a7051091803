"""The broker at fleet size: 256, 1,024 and 4,096 connected workers heartbeating, 16 of them leasing and submitting.

    .venv/bin/python -m bench.broker_scale [--fleets 256,1024,4096] [--seconds 10] [--fanout 64,256] [--mb 50]
                                           [--fleet-nice 10] [--reference-tree DIR | --unlimited-reference]

Fleet processes (at ``--fleet-nice``, as if on other hosts) hold up to 1,024 idle workers each, beating at the
interval the broker asks for. At each fleet size on one broker: its idle CPU, heartbeats/s and RSS per worker;
then 16 active workers lease, "generate" ``--generate-ms`` and submit 16 KB groups against a learner of 1-s steps
publishing a tiny adapter each: lease p50 / p99, groups/s, CPU per group above idle, and where the grants over
20 ms waited. Also ``BrokerCore`` alone per idle heartbeat (in-process CPU, hardly moved by load); at the largest
size, the time until the broker drops a SIGKILLed fleet process's workers; ``--fanout``: N fetchers of one
``--mb`` MB adapter against one direct send. Targets (issue 16) at 4,096: idle <= 25 % of a core (the value,
against 0.25), lease p99 <= 20 ms.
"""

from __future__ import annotations

import bisect
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

from bench import harness
from bench.adapter_fanout import direct_time, fanout_times
from bench.broker_throughput import end_step
from bench.harness import REPO, adapter_tensors, codec, group_record, group_tensors
from loraflow.broker.stats import pass_quantile
from loraflow.common.protocol import AdapterUpdate, BatchRequest, Heartbeat, Hello, Kind, LeaseRequest
from loraflow.common.transport import fetch_stats

PER_PROCESS = 1024  # worker sockets per fleet process
ACTIVE_WORKERS = 16
GROUPS_PER_STEP = 256  # the learner's batch: more than the active workers offer per step, so no backpressure
STEP_S = 1.0  # the learner's step: one adapter version (one notice per worker) per second
GROUP_BYTES = 16 << 10
H100_TOKENS_PER_S = 6300  # a 7 B model generating on one H100 (issue 16)
WIRE_BYTES_PER_TOKEN = 4 + 4 + 4 + 1  # completion id int32, log-prob f32, version int32, loss mask u8
#: what an idle rollout worker's heartbeat carries (rollout_worker/worker.py's _report)
IDLE_COUNTERS = {"groups_submitted": 1200, "tokens_generated": 4_800_000, "reward_failures": 0,
                 "adapters_received": 40, "unacked": 0}
FLEET_TICK_S = 0.005  # the fleet's send/read granularity
SLOW_GRANT_MS = 20.0  # the lease p99 target: slower grants are the tail the bench attributes
NEAR_PUBLISH_S = 0.1  # a grant asked for this long before a publish, or while it went out, overlaps its burst
INTERVAL_S, MISSES = 1.0, 5  # the broker's default heartbeat interval and misses (common/config.py)


def stats(endpoint: str) -> dict:
    return fetch_stats(endpoint, timeout_s=10)


def connect_workers(ctx: zmq.Context, endpoint: str, names: list[str]) -> list[zmq.Socket]:
    """One DEALER per name, all saying Hello at once (one by one, the first would time out before the last is
    welcomed) as a BrokerLink does: its silence timeout, and that it follows a longer interval the broker asks."""
    socks, poller = [], zmq.Poller()
    for name in names:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart(codec.encode(Hello(role="worker", client_id=name, backend="sim", session=name,
                                               batched_acks=True, silence_timeout_s=INTERVAL_S * MISSES,
                                               heartbeat_interval_s=INTERVAL_S)))
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    waiting, deadline = set(socks), time.monotonic() + 120
    while waiting:
        if time.monotonic() > deadline:
            raise SystemExit(f"fleet: {len(waiting)} of {len(socks)} workers never welcomed")
        for sock, _ in poller.poll(1000):
            kind, body = harness.kind_and_header(sock.recv_multipart(copy=False))
            if kind == Kind.ERROR:
                raise SystemExit(f"fleet: refused: {body}")
            if kind == Kind.WELCOME:
                waiting.discard(sock)
    return socks


def asked_interval(frames: list, interval_s: float) -> float:
    """A pong's ``interval_s`` when longer than the worker's own (as BrokerLink._follow), else ``interval_s``."""
    if harness.kind(frames) != Kind.HEARTBEAT:
        return interval_s
    return max(INTERVAL_S, msgpack.unpackb(frames[1].buffer).get("interval_s", 0.0))


def fleet(endpoint: str, prefix: str, n: int, nice: int, ready: mp.Queue, stop: mp.Event) -> None:
    """``n`` idle workers at ``nice``: each beats once per (asked) interval, spread over it, and each socket is
    read about once per interval in turn (no poll over a thousand sockets)."""
    os.nice(nice)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 64)
    socks = connect_workers(ctx, endpoint, [f"{prefix}-{i}" for i in range(n)])
    ready.put(n)
    beat = codec.encode(Heartbeat(state="idle", counters=IDLE_COUNTERS))
    interval_s, start = INTERVAL_S, time.monotonic()
    due = [start + interval_s * i / n for i in range(n)]
    turn = read_turn = 0
    while not stop.is_set():
        now = time.monotonic()
        while due[turn] <= now:
            socks[turn].send_multipart(beat)
            due[turn] += interval_s
            turn = (turn + 1) % n
        for _ in range(int(max(1, -(-n * FLEET_TICK_S // interval_s)))):
            sock, read_turn = socks[read_turn], (read_turn + 1) % n
            with contextlib.suppress(zmq.Again):
                while True:
                    interval_s = asked_interval(sock.recv_multipart(zmq.NOBLOCK, copy=False), interval_s)
        time.sleep(max(0.0, min(due[turn], now + FLEET_TICK_S) - time.monotonic()))
    ctx.destroy(linger=0)


def runqueue_ms(pid: int | None = None) -> float:
    """Milliseconds the process's main thread has spent runnable but waiting for a core (/proc schedstat)."""
    with open(f"/proc/{pid or 'self'}/schedstat") as stat:
        return int(stat.read().split()[1]) / 1e6


def active(endpoint: str, seconds: float, generate_s: float, results: mp.Queue) -> None:
    """ACTIVE_WORKERS workers each leasing one prompt, "generating" ``generate_s``, submitting a 16 KB group and
    asking again; puts ([(asked at, ms to the grant, this process's run-queue ms meanwhile)] per lease granted,
    groups accepted, empty grants by reason, seconds)."""
    ctx = zmq.Context()
    names = [f"active-{os.getpid()}-{i}" for i in range(ACTIVE_WORKERS)]
    socks = connect_workers(ctx, endpoint, names)
    index = {sock: i for i, sock in enumerate(socks)}
    tensors = group_tensors(GROUP_BYTES)
    template = codec.encode(group_record("0:0", "L", names[0], tensors), tensors)
    header, packer = msgpack.unpackb(template[1]), msgpack.Packer(use_bin_type=True)
    ask, beat = codec.encode(LeaseRequest(max_leases=1, wait_ms=1000)), codec.encode(Heartbeat(state="generating"))
    asked: dict[int, tuple[float, float]] = {}  # worker -> (when its request went out, run-queue ms then)
    generating: list[tuple[float, int, dict]] = []  # (done at, worker, lease)
    grants: list[tuple[float, float, float]] = []
    accepted, empty = 0, {}

    def ask_for(i: int) -> None:
        socks[i].send_multipart(ask)
        asked[i] = (time.perf_counter(), runqueue_ms())

    poller = zmq.Poller()
    for i, sock in enumerate(socks):
        poller.register(sock, zmq.POLLIN)
        ask_for(i)
    interval_s, start = INTERVAL_S, time.perf_counter()
    next_beat = time.monotonic() + interval_s
    while (now := time.perf_counter()) - start < seconds:
        if time.monotonic() >= next_beat:
            for sock in socks:
                sock.send_multipart(beat)
            next_beat += interval_s
        while generating and generating[0][0] <= now:
            _, i, lease = generating.pop(0)
            header["group_id"], header["lease_id"], header["worker_id"] = lease["group_id"], lease["lease_id"], names[i]
            socks[i].send_multipart([template[0], packer.pack(header), *template[2:]], copy=False)
            ask_for(i)
        for sock, _ in poller.poll(50 if not generating else max(0, min(50, int((generating[0][0] - now) * 1000)))):
            frames, i = sock.recv_multipart(copy=False), index[sock]
            kind, body = harness.kind_and_header(frames)
            if kind == Kind.LEASE_GRANT and not body["leases"]:
                empty[body["reason"]] = empty.get(body["reason"], 0) + 1
                ask_for(i)
            elif kind == Kind.LEASE_GRANT:
                grants.append((asked[i][0], (time.perf_counter() - asked[i][0]) * 1000, runqueue_ms() - asked[i][1]))
                generating.append((time.perf_counter() + generate_s, i, body["leases"][0]))
            elif kind == Kind.ACK:
                accepted += len(body.get("ref_ids") or [None])
            else:
                interval_s = asked_interval(frames, interval_s)
    results.put((grants, accepted, empty, now - start))
    ctx.destroy(linger=0)


def learner(endpoint: str, ready: mp.Queue, stop: mp.Event, publishes: Path) -> None:
    """A learner whose step takes STEP_S: batch, wait, ack and publish a tiny adapter (a notice to every worker);
    appends each publish's perf_counter time (CLOCK_MONOTONIC, comparable across processes) to ``publishes``."""
    ctx = zmq.Context()
    sock = harness.dealer(ctx, endpoint, "learner", "scale")
    ready.put("learner")
    version = 0
    while not stop.is_set():
        sock.send_multipart(codec.encode(BatchRequest(num_groups=GROUPS_PER_STEP, wait_ms=1000,
                                                      learner_version=version)))
        while not stop.is_set() and not (sock.poll(100) and harness.kind(frames := sock.recv_multipart(copy=False))
                                         == Kind.BATCH):
            pass
        if not stop.is_set() and (batch := msgpack.unpackb(frames[1].buffer))["groups"]:
            time.sleep(STEP_S)
            version += 1
            end_step(sock, batch, version, version, checkpoint_version=version)
            with publishes.open("a") as out:
                out.write(f"{time.perf_counter()}\n")
    ctx.destroy(linger=0)


def idle_window(pid: int, endpoint: str, seconds: float) -> dict[str, float]:
    """Over ``seconds``: the broker's CPU (all threads; the main thread) per core, heartbeats received per second,
    CPU per heartbeat, and the machine's busy share (of all its cores)."""
    beats0 = stats(endpoint)["messages_in"].get("heartbeat", 0)
    threads0, busy0, start = harness.thread_cpu(pid), harness.machine_busy_ticks(), time.monotonic()
    time.sleep(seconds)
    threads, busy, elapsed = harness.thread_cpu(pid), harness.machine_busy_ticks(), time.monotonic() - start
    beats = (stats(endpoint)["messages_in"].get("heartbeat", 0) - beats0) / elapsed
    total = (sum(threads.values()) - sum(threads0.values())) / elapsed
    return {"idle_core_share": round(total, 4), "main_thread_share": round((threads["main"] - threads0["main"]) / elapsed, 4),
            "heartbeats_per_s": round(beats, 1), "us_per_heartbeat": round(total / max(beats, 1e-9) * 1e6, 1),
            "machine_busy": round((busy[0] - busy0[0]) / max(1, busy[1] - busy0[1]), 3)}


#: run with a checkout's code (argv: workers, beats per loop pass, counters): the core's CPU per heartbeat
CORE_COST = """
import sys, time
from bench.harness import codec
from loraflow.broker.core import BrokerCore
from loraflow.common import config as cfg, logging, protocol as p, tasks
logging.setup_logging("broker", level="warning")
n, per_pass, counters = int(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3])
config = cfg.load_config(None, [f"broker.max_workers={n + 8}"])
core = BrokerCore(config, task=tasks.load_task(config.run.task, config.run.seed), now_s=0.0)
ids = [f"worker/w{i}".encode() for i in range(n)]
for i, identity in enumerate(ids):
    core.handle(identity, codec.encode(p.Hello(role="worker", client_id=f"w{i}", session="s")), 0.0)
core.flush(0.0)
beat = codec.encode(p.Heartbeat(state="idle", counters=counters))
now, best = 0.0, float("inf")
for _ in range(4):
    start = time.process_time()
    for k in range(0, n, per_pass):
        for identity in ids[k:k + per_pass]:
            core.handle(identity, beat, now)
        now += per_pass / n
        core.tick(now)
        core.flush(now)
    best = min(best, (time.process_time() - start) / n)
print(best * 1e6)
"""


def core_cost(tree: Path, workers: int, per_pass: int = 4) -> float:
    """Microseconds of ``tree``'s broker core per idle heartbeat (handle + tick + flush every ``per_pass`` beats,
    in-process, no sockets; the best of 4 rounds over ``workers`` peers)."""
    return float(harness.in_tree(["-c", CORE_COST, str(workers), str(per_pass), repr(IDLE_COUNTERS)], tree))


def loop_during(before: dict | None, after: dict | None) -> dict | None:
    """The broker loop's passes between two Stats ``loop`` snapshots: how many, their p99 bucket, how many over
    20 ms, and the slowest pass, step and gc of its last stats window (None for a broker without them)."""
    if not before or not after:
        return None
    passes = {k: after["passes"].get(k, 0) - before["passes"].get(k, 0) for k in after["passes"]}
    return {"passes": sum(passes.values()), "p99_ms": pass_quantile(passes, 0.99),
            "over_20ms": sum(v for k, v in passes.items() if k == "inf" or int(k) > 20),
            **{k: after.get(k) for k in ("slowest_pass_ms", "slowest_pass_cpu_ms", "slowest_step", "slowest_step_ms",
                                         "slowest_gc_ms")},
            "gc_collections": {k: v - before.get("gc_collections", {}).get(k, 0)
                               for k, v in after.get("gc_collections", {}).items()}}


def tail_causes(grants: list[tuple[float, float, float]], publishes: Path, broker_queued_ms: float,
                elapsed_s: float) -> dict:
    """Where the grants over SLOW_GRANT_MS waited: the share asked for shortly before or during a publish against
    that share of all grants, and the leasing process's run-queue wait in a slow grant against any grant's."""
    times = sorted(float(line) for line in publishes.read_text().split()) if publishes.exists() else []

    def near_publish(asked: float, latency_ms: float) -> bool:
        i = bisect.bisect_left(times, asked - NEAR_PUBLISH_S)
        return i < len(times) and times[i] <= asked + latency_ms / 1000

    def share(rows: list) -> float:
        return sum(near_publish(asked, latency) for asked, latency, _ in rows) / len(rows) if rows else 0.0

    slow = [g for g in grants if g[1] > SLOW_GRANT_MS]
    return {"slow": len(slow), "slow_near_publish": round(share(slow), 3), "all_near_publish": round(share(grants), 3),
            "slow_client_queued_ms": round(harness.median(q for *_, q in slow), 2) if slow else 0.0,
            "all_client_queued_ms": round(harness.median(q for *_, q in grants), 3) if grants else 0.0,
            "broker_queued_share": round(broker_queued_ms / 1000 / elapsed_s, 4)}


def at_size(pid: int, endpoint: str, size: int, empty_rss_kb: int, args, results: mp.Queue, publishes: Path) -> dict:
    """The idle window, then the active phase, with ``size`` fleet workers connected."""
    harness.wait_until(lambda: int(stats(endpoint)["num_workers"]) >= size, 60, f"{size} workers counted",
                       interval_s=0.5)
    asked = stats(endpoint)["settings"].get("heartbeat_interval_asked_s", INTERVAL_S)
    time.sleep(asked * 2)  # every worker has beaten at least once, at the interval it is asked for
    row = {**idle_window(pid, endpoint, args.seconds), "interval_asked_s": asked}
    idle, rss = row["idle_core_share"], harness.rss_bytes(pid) // 1024
    loop_before = stats(endpoint).get("loop")
    worker = harness.spawn(active, endpoint, args.seconds, args.generate_ms / 1000, results)
    cpu0, start, queued0 = harness.cpu_seconds(pid), time.monotonic(), runqueue_ms(pid)
    grants, accepted, empty, elapsed = results.get(timeout=args.seconds + 120)
    queued = runqueue_ms(pid) - queued0
    busy = (harness.cpu_seconds(pid) - cpu0) / (time.monotonic() - start)
    # the broker's CPU per group above idle (None when a busy machine's noise drowns it: busy not above idle)
    us_per_group = (busy - idle) / max(accepted / elapsed, 1e-9) * 1e6 if busy > idle else None
    worker.join(10)
    p50, p99 = np.percentile([g[1] for g in grants], [50, 99]) if grants else (float("nan"),) * 2
    return {**row, "rss_mb": round(rss / 1024, 1), "kb_per_worker": round((rss - empty_rss_kb) / size, 2),
            "lease_p50_ms": round(float(p50), 2), "lease_p99_ms": round(float(p99), 2), "grants": len(grants),
            "empty_grants": empty, "groups_per_s": round(accepted / elapsed, 1), "active_core_share": round(busy, 4),
            "us_per_group": round(us_per_group, 1) if us_per_group else None,
            "capacity_groups_per_s": round((1 - idle) / us_per_group * 1e6) if us_per_group else None,
            "loop": loop_during(loop_before, stats(endpoint).get("loop")),
            "tail": tail_causes(grants, publishes, queued, elapsed)}


def death(endpoint: str, victim: mp.Process, victim_n: int) -> dict:
    """SIGKILL one fleet process: seconds until the broker no longer counts its workers, next to its timeout."""
    snapshot = stats(endpoint)
    settings, before = snapshot["settings"], int(snapshot["num_workers"])
    # dropped before the kill: earlier phases' active workers (gone without a Bye), live ones heard too late
    dead_before = int(snapshot["peers_gone"].get("dead", 0))
    os.kill(victim.pid, signal.SIGKILL)
    killed, death_s = time.monotonic(), None
    while death_s is None and time.monotonic() - killed < 60:
        if int(stats(endpoint)["num_workers"]) <= before - victim_n:
            death_s = round(time.monotonic() - killed, 2)
        time.sleep(0.05)
    return {"death_detect_s": death_s, "heartbeat_timeout_s": settings.get("heartbeat_timeout_s", INTERVAL_S * MISSES),
            "interval_asked_s": settings.get("heartbeat_interval_asked_s", INTERVAL_S), "killed": victim_n,
            "counted_before": before, "dead_before_kill": dead_before}


def fleet_sizes(workdir: Path, sizes: list[int], args, *, tree: Path = REPO, label: str = "",
                overrides: tuple[str, ...] = ()) -> dict[int, dict]:
    """Grow one broker's fleet to each size and measure there (:func:`at_size`); kill a fleet at the end."""
    spawn = mp.get_context("spawn")
    stop, ready, results = spawn.Event(), spawn.Queue(), spawn.Queue()
    workdir.mkdir()
    broker, endpoint = harness.start_broker(
        workdir, *overrides, f"broker.max_workers={max(sizes) + 2 * ACTIVE_WORKERS + 8}",
        f"broker.heartbeat_interval_s={INTERVAL_S}", f"broker.heartbeat_misses={MISSES}", "run.group_size=8",
        f"run.groups_per_step={GROUPS_PER_STEP}", "run.max_staleness=1000",
        f"broker.capacity_groups={4 * GROUPS_PER_STEP}", "broker.max_leases_per_worker=4", tree=tree)
    fleets: list[tuple[mp.Process, int, mp.Event]] = []
    out: dict[int, dict] = {}
    trainer = None
    try:
        time.sleep(1.0)
        empty_rss, cpu0, start = harness.rss_bytes(broker.pid) // 1024, harness.cpu_seconds(broker.pid), time.monotonic()
        time.sleep(args.seconds / 2)
        print(f"{label}empty broker: RSS {empty_rss / 1024:.1f} MB, idle CPU "
              f"{(harness.cpu_seconds(broker.pid) - cpu0) / (time.monotonic() - start):.1%} of a core", flush=True)
        publishes = workdir / "publishes.txt"
        trainer = harness.spawn(learner, endpoint, ready, stop, publishes)
        ready.get(timeout=30)
        for size in sizes:
            while (connected := sum(n for _, n, _ in fleets)) < size:
                n = min(PER_PROCESS, size - connected)
                own_stop = spawn.Event()  # a fleet SIGKILLed inside a shared Event's is_set() would leave its lock held
                fleets.append((harness.spawn(fleet, endpoint, f"f{len(fleets)}", n, args.fleet_nice, ready, own_stop),
                               n, own_stop))
                ready.get(timeout=180)
            out[size] = at_size(broker.pid, endpoint, size, empty_rss, args, results, publishes)
            print(f"{label}{size} workers: idle {out[size]['idle_core_share']:.1%} of a core, lease p99 "
                  f"{out[size]['lease_p99_ms']:.1f} ms", flush=True)
        out[max(sizes)].update(death(endpoint, *fleets[-1][:2]))
        return out
    finally:
        stop.set()
        if trainer is not None:
            trainer.join(timeout=10)
        for child, _, own_stop in fleets:
            if child.is_alive():  # never the killed one's Event (see above)
                own_stop.set()
        harness.reap([child for child, _, _ in fleets], broker)


def fanout(workdir: Path, counts: list[int], mb: float) -> dict[int, dict]:
    """Time until N fetchers (in 4 processes) hold one new ``mb`` MB adapter, published once, against one direct
    send of its bytes."""
    tensors = adapter_tensors(int(mb * (1 << 20)))
    num_bytes = sum(t.nbytes for _, t in tensors)
    direct = direct_time(codec.encode(AdapterUpdate(version=1, step=1, sha256="", adapter_config={}), tensors), 3)
    out = {}
    for count in counts:
        (done,) = fanout_times(tensors, count, 1, workdir / f"fanout-{count}", per_process=-(-count // 4), warmup=False,
                               overrides=(f"broker.max_workers={count + 8}",))
        out[count] = {"seconds": round(done[-1], 3), "median_s": round(harness.median(done), 3),
                      "broker_bytes_sent": num_bytes * count, "direct_s": round(direct, 4),
                      "ratio_to_direct": round(done[-1] / direct, 1), "gb_per_s": round(num_bytes * count / done[-1] / 1e9, 2)}
    harness.table(["fetchers", "adapter MB", "all hold it after", "median", "broker sent", "direct send", "ratio"],
                  ([n, f"{num_bytes / 1e6:.0f}", f"{r['seconds']:.2f} s", f"{r['median_s']:.2f} s",
                    f"{r['broker_bytes_sent'] / 1e9:.1f} GB at {r['gb_per_s']:.2f} GB/s", f"{direct:.3f} s",
                    f"{r['ratio_to_direct']:.0f}x (floor {n}x)"] for n, r in out.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = harness.flags(harness.parser(__doc__, seconds=10.0), {
        "fleets": ("256,1024,4096", "connected workers, comma-separated, ascending"),
        "generate_ms": (100.0, "active workers: grant to submission"),
        "fanout": ("64,256", "fetchers for the adapter fan-out ('' for none)"),
        "mb": (50.0, "adapter size for the fan-out"),
        "fleet_nice": (10, "niceness of the fleet processes"),
    })
    parser.add_argument("--reference-tree", type=Path, default=None, help="another checkout whose broker is "
                        "measured first, with the same clients")
    parser.add_argument("--unlimited-reference", action="store_true", help="measure this broker first with no "
                        "heartbeat budget (broker.max_heartbeats_per_second=0), then with the configured one")
    args = harness.parse(parser, argv, fleets="16", seconds=0.5, fanout="2", mb=1.0)
    sizes = sorted(harness.sizes(args.fleets))
    reference = args.reference_tree.resolve() if args.reference_tree is not None else None
    print(f"machine load {harness.load_average()}; fleet at nice {args.fleet_nice}", flush=True)
    core_us = {"after": core_cost(REPO, max(sizes))}
    if reference is not None:
        core_us["before"] = core_cost(reference, max(sizes))
    print(f"broker core alone per idle heartbeat at {max(sizes)} workers (us of CPU): {core_us}", flush=True)
    runs: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=REPO) as tmp:
        if reference is not None:
            runs["before"] = fleet_sizes(Path(tmp) / "before", sizes, args, tree=reference, label="before: ")
        elif args.unlimited_reference:
            runs["no budget"] = fleet_sizes(Path(tmp) / "before", sizes, args, label="no budget: ",
                                            overrides=("broker.max_heartbeats_per_second=0",))
        runs["after" if runs else ""] = scale = fleet_sizes(Path(tmp) / "fleet", sizes, args)
        fan = fanout(Path(tmp), harness.sizes(args.fanout), args.mb) if args.fanout else {}
    harness.table(["run", "workers", "interval asked", "idle CPU (main thread)", "heartbeats/s (us each)",
                   "machine busy", "RSS (KB/worker)", "lease p50 / p99", "grants (empty)", "groups/s (us each above idle)",
                   "grants > 20 ms: near a publish (all grants)", "run-queue ms slow / any grant; broker",
                   "loop passes > 20 ms; slowest pass, step, gc"],
                  ([run, n, f"{r['interval_asked_s']:g} s", f"{r['idle_core_share']:.1%} ({r['main_thread_share']:.1%})",
                    f"{r['heartbeats_per_s']:.0f} ({r['us_per_heartbeat']:.0f})", f"{r['machine_busy']:.0%}",
                    f"{r['rss_mb']} MB ({r['kb_per_worker']:.1f})", f"{r['lease_p50_ms']:.1f} / {r['lease_p99_ms']:.1f} ms",
                    f"{r['grants']} ({r['empty_grants'] or 'none'})", f"{r['groups_per_s']:.0f} ({r['us_per_group']})",
                    f"{r['tail']['slow']}: {r['tail']['slow_near_publish']:.0%} ({r['tail']['all_near_publish']:.0%})",
                    f"{r['tail']['slow_client_queued_ms']} / {r['tail']['all_client_queued_ms']}; "
                    f"{r['tail']['broker_queued_share']:.1%} of the phase",
                    "-" if not r["loop"] else f"{r['loop']['over_20ms']} of {r['loop']['passes']}; "
                    f"{r['loop']['slowest_pass_ms']:.1f} ms, {r['loop']['slowest_step']} {r['loop']['slowest_step_ms']:.1f}"
                    f" ms, {r['loop']['slowest_gc_ms']} ms"] for run, by_size in runs.items() for n, r in by_size.items()))
    top = scale[max(sizes)]
    print(f"death: {top['killed']} of {top['counted_before']} workers SIGKILLed, gone from the broker's stats after "
          f"{top['death_detect_s']} s (None: not within 60 s); timeout {top['heartbeat_timeout_s']:.2f} s; dropped as "
          f"dead before the kill: {top['dead_before_kill']} (the earlier phases' active workers: "
          f"{ACTIVE_WORKERS * (len(sizes) - 1)})", flush=True)
    capacity = top["capacity_groups_per_s"]
    h100s = capacity * GROUP_BYTES / WIRE_BYTES_PER_TOKEN / H100_TOKENS_PER_S if capacity else None
    if capacity:
        print(f"as a fleet: one broker core carries {capacity} groups/s of 16 KB at {max(sizes)} workers, the tokens "
              f"of {h100s:.0f} H100s generating a 7 B model at {H100_TOKENS_PER_S} tokens/s", flush=True)
    harness.report("broker_scale", f"broker idle CPU at {max(sizes)} workers (share of one core)",
                   top["idle_core_share"], "cores", 0.25, idle_core_share=top["idle_core_share"],
                   lease_p99_ms=top["lease_p99_ms"], kb_per_worker=top["kb_per_worker"],
                   death_detect_s=top.get("death_detect_s"), heartbeat_timeout_s=top.get("heartbeat_timeout_s"),
                   h100_equivalent=round(h100s) if h100s else None, fleet_nice=args.fleet_nice,
                   core_us_per_heartbeat=core_us, by_fleet={str(k): v for k, v in scale.items()},
                   before={str(k): v for k, v in next(iter(runs.values())).items()} if len(runs) > 1 else {},
                   fanout={str(k): v for k, v in fan.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
