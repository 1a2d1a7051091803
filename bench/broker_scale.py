"""The broker at fleet size: 256, 1,024 and 4,096 connected workers heartbeating, 16 of them leasing and submitting.

    .venv/bin/python -m bench.broker_scale [--fleets 256,1024,4096] [--seconds 10] [--fanout 64,256] [--mb 50]
                                           [--fleet-nice 10] [--reference-tree /path/to/an/older/checkout]

A few "fleet" processes each hold many DEALER sockets, one per worker: each says Hello as a worker and then
heartbeats at the broker's interval (spread over it, as independent workers would) with what an idle worker's
heartbeat carries (state, version, its five counters: ~190 bytes), and reads everything the broker sends (in
turn, each socket about once per interval, without decoding: an idle worker's reads cost its host, not the
broker). The fleet grows to each size in turn on one broker process; at each size, in the same run:

- idle: the broker's CPU (all threads, /proc; also its main thread alone) over ``--seconds`` while the fleet
  only heartbeats, as a share of one core; the heartbeats it received per second in that window (from its
  stats) and so its CPU per heartbeat; and its RSS: the growth from the empty broker divided by the workers
  gives KB per worker;
- active: 16 more workers (one process) each long-poll for one lease, "generate" for ``--generate-ms``, submit a
  16 KB group and ask again (160 leases/s at the default 100 ms: a busy fleet's rate, not a flood), while a
  learner whose steps take 1 s takes batches of 256 groups (no backpressure), acks them and publishes a tiny
  adapter per step (an AdapterNotice to every connected worker): lease-grant latency p50 / p99 (request sent ->
  grant with a lease received), groups/s, and the broker's CPU per group above its idle load, hence the groups/s
  one broker core carries at that fleet size, also as the fleet of H100s that would produce them; and where the
  grants over 20 ms waited: the share of them that overlapped one of the learner's publishes (asked for within
  100 ms before it or while it went out) against that share of all grants, and the run-queue waits of the
  leasing process during them and of the broker's main thread over the phase (/proc schedstat);
- core: before the fleet, the broker core alone (``BrokerCore.handle`` + ``tick`` + ``flush`` in-process, no
  sockets) per idle worker's heartbeat at the largest size, in CPU time: the part of the idle cost the broker's
  Python decides, and a figure this shared machine's load hardly moves (the socket figures above it do);
- death: one fleet process is SIGKILLed at the largest size; the time until the broker's stats no longer count
  its workers, next to the heartbeat timeout (the interval asked of that fleet x misses).

The heartbeat budget (``broker.max_heartbeats_per_second``, default 2,000): a fleet larger than that many workers
per configured interval is asked to beat more slowly (Nomad's servers stretch their clients' heartbeat TTL the
same way); every fleet socket says in its Hello that it follows, as a BrokerLink does, and takes the interval
from the pongs it reads. ``--unlimited-reference`` measures the same broker with no budget first (every worker at
1 s), then with the configured one: the idle cost, the lease tail and the death time side by side.

Adapter fan-out at fleet size (``--fanout``): N fetchers (in a few processes) hold Hello sessions; a learner
publishes one ``--mb`` MB adapter; each fetcher gets the AdapterNotice, fetches, and records when the whole
AdapterUpdate arrived. Next to it: the broker's bytes sent (N x the adapter) and the same bytes sent once over a
direct PUSH -> PULL pair, so the ratio says what the star costs against the wire's floor.

The fleet emulates workers on other hosts, but here it shares the broker's cores: the fleet processes run at
``--fleet-nice`` (default 10), so the broker, the active workers and the learner (nice 0) get the CPU first, as
they would if the fleet's thousands of sockets were on their own machines; ``--fleet-nice 0`` is the earlier
method, where four fleet processes (about a core of heartbeat traffic) compete with the broker on equal terms
and the lease tail measures this 2-core box's time slices more than the broker. With ``--reference-tree`` the
same measurement runs first against the broker of another checkout (``git worktree add /tmp/ref <commit>``),
with the same clients, and both are printed: a before/after on one machine in one run.

Targets (issue 16): idle overhead <= 25 % of one core at 4,096 workers, lease p99 <= 20 ms, RSS per worker small
and linear. The JSON line: ``idle_core_share``, ``lease_p99_ms`` and ``kb_per_worker`` at the largest size
(value = idle core share, reference = the 0.25 target).
"""

from __future__ import annotations

import bisect
import contextlib
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import zmq

from bench import harness
from bench.adapter_fanout import adapter_tensors, direct_time
from bench.broker_proc import REPO, start_broker
from bench.broker_throughput import (
    end_step,
    group_record,
    group_tensors,
)
from bench.harness import codec
from bench.report import report
from loraflow.broker.stats import pass_quantile
from loraflow.common import framing
from loraflow.common.protocol import (
    AdapterFetch,
    AdapterUpdate,
    BatchRequest,
    Heartbeat,
    Hello,
    Kind,
    LeaseRequest,
)
from loraflow.common.transport import fetch_stats

PER_PROCESS = 1024  # worker sockets per fleet process
ACTIVE_WORKERS = 16
GROUPS_PER_STEP = 256  # the learner's batch: more than the active workers offer per step, so no backpressure
STEP_S = 1.0  # the learner's step time: one adapter version (and one notice per worker) per second
GROUP_BYTES = 16 << 10
H100_TOKENS_PER_S = 6300  # a 7 B model generating on one H100 (issue 16)
WIRE_BYTES_PER_TOKEN = 4 + 4 + 4 + 1  # completion id int32, log-prob f32, version int32, loss mask u8
#: what an idle rollout worker's heartbeat carries (rollout_worker/worker.py's _report)
IDLE_COUNTERS = {"groups_submitted": 1200, "tokens_generated": 4_800_000, "reward_failures": 0,
                 "adapters_received": 40, "unacked": 0}
FLEET_TICK_S = 0.005  # the fleet's send/read granularity
SLOW_GRANT_MS = 20.0  # the lease p99 target: grants slower than this are the tail the bench attributes
NEAR_PUBLISH_S = 0.1  # a grant asked for this long before a publish, or while it went out, overlaps its burst


def kind_of(frames: list) -> int:
    return framing.PREAMBLE.unpack(frames[0].buffer)[2]


INTERVAL_S = 1.0  # the broker's default heartbeat interval (common/config.py), each worker's own
SILENCE_TIMEOUT_S = INTERVAL_S * 5  # what a worker's BrokerLink says in its Hello: interval x misses


def connect_workers(ctx: zmq.Context, endpoint: str, names: list[str]) -> list[zmq.Socket]:
    """One DEALER per name, each welcomed by the broker as a worker (its Hello says what a real worker's says:
    the silence timeout, so a broker that knows it answers every second beat, an older one every beat; its own
    interval, so it follows a longer one the broker asks for, as a BrokerLink does)."""
    socks = []
    for name in names:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart(codec.encode(Hello(role="worker", client_id=name, backend="sim",
                                                  session=uuid.uuid4().hex[:8], batched_acks=True,
                                                  silence_timeout_s=SILENCE_TIMEOUT_S,
                                                  heartbeat_interval_s=INTERVAL_S)))
        socks.append(sock)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    waiting = set(range(len(socks)))
    index = {sock: i for i, sock in enumerate(socks)}
    deadline = time.monotonic() + 120
    while waiting:
        if time.monotonic() > deadline:
            raise SystemExit(f"fleet: {len(waiting)} of {len(socks)} workers never welcomed")
        for sock, _ in poller.poll(1000):
            frames = sock.recv_multipart(copy=False)
            if kind_of(frames) == Kind.WELCOME:
                waiting.discard(index[sock])
            elif kind_of(frames) == Kind.ERROR:
                raise SystemExit(f"fleet: refused: {msgpack.unpackb(frames[1].buffer)}")
    return socks


def asked_interval(frames: list, interval_s: float) -> float:
    """The interval a worker beats at after reading ``frames``: a pong's ``interval_s`` when longer than its own
    (loraflow.common.transport.BrokerLink._follow), else ``interval_s`` unchanged."""
    if kind_of(frames) != Kind.HEARTBEAT:
        return interval_s
    return max(INTERVAL_S, msgpack.unpackb(frames[1].buffer).get("interval_s", 0.0))


def fleet(endpoint: str, prefix: str, n: int, interval_s: float, nice: int, ready: mp.Queue, stop: mp.Event
          ) -> None:
    """``n`` workers that heartbeat every ``interval_s`` (spread over the interval), or the longer one the
    broker's pongs ask for, and read what arrives (each socket about once per interval, in turn: no poll over a
    thousand sockets), at ``nice``. The asked interval is taken for every socket at the first pong that says it
    (a real worker takes it at its own next pong, within about one interval)."""
    os.nice(nice)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 64)  # a context option (setsockopt would set a socket default)
    socks = connect_workers(ctx, endpoint, [f"{prefix}-{i}" for i in range(n)])
    ready.put(n)
    beat = codec.encode(Heartbeat(state="idle", counters=IDLE_COUNTERS))
    start = time.monotonic()
    due = [start + interval_s * i / n for i in range(n)]
    turn = 0  # the next socket to beat, in order
    read_turn = 0
    while not stop.is_set():
        now = time.monotonic()
        while due[turn] <= now:
            socks[turn].send_multipart(beat)
            due[turn] += interval_s
            turn = (turn + 1) % n
        for _ in range(int(max(1, -(-n * FLEET_TICK_S // interval_s)))):
            sock = socks[read_turn]
            read_turn = (read_turn + 1) % n
            with contextlib.suppress(zmq.Again):
                while True:
                    interval_s = asked_interval(sock.recv_multipart(zmq.NOBLOCK, copy=False), interval_s)
        time.sleep(max(0.0, min(due[turn], now + FLEET_TICK_S) - time.monotonic()))
    for sock in socks:
        sock.close(0)
    ctx.term()


def active(endpoint: str, seconds: float, interval_s: float, generate_s: float, results: mp.Queue) -> None:
    """ACTIVE_WORKERS workers each leasing one prompt at a time, "generating" for ``generate_s`` and then
    submitting a 16 KB group and asking again; puts (per grant carrying a lease: when it was asked for
    (perf_counter), ms until it arrived, and this process's run-queue wait in that time; groups accepted, grants
    without a lease by reason, seconds)."""
    ctx = zmq.Context()
    names = [f"active-{os.getpid()}-{i}" for i in range(ACTIVE_WORKERS)]
    socks = connect_workers(ctx, endpoint, names)
    tensors = group_tensors(GROUP_BYTES)
    template = codec.encode(group_record("0:0", "L", names[0], tensors), tensors)
    header = msgpack.unpackb(template[1])
    packer = msgpack.Packer(use_bin_type=True)
    ask = codec.encode(LeaseRequest(max_leases=1, wait_ms=1000))
    beat = codec.encode(Heartbeat(state="generating"))
    poller = zmq.Poller()
    asked_at: dict[int, float] = {}  # worker -> when its outstanding request was sent
    queued_at: dict[int, float] = {}  # worker -> this thread's run-queue wait (ms) when its request was sent
    generating: list[tuple[float, int, dict]] = []  # (done at, worker, lease)
    for i, sock in enumerate(socks):
        poller.register(sock, zmq.POLLIN)
        sock.send_multipart(ask)
        asked_at[i], queued_at[i] = time.perf_counter(), runqueue_ms()
    index = {sock: i for i, sock in enumerate(socks)}
    latencies: list[float] = []
    grants: list[tuple[float, float, float]] = []  # (asked at, latency ms, this thread's run-queue wait ms meanwhile)
    accepted = 0
    empty: dict[str, int] = {}  # reason -> grants without a lease
    start = time.perf_counter()
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
            socks[i].send_multipart(ask)
            asked_at[i], queued_at[i] = time.perf_counter(), runqueue_ms()
        wait_ms = 50 if not generating else max(0, min(50, int((generating[0][0] - now) * 1000)))
        for sock, _ in poller.poll(wait_ms):
            frames = sock.recv_multipart(copy=False)
            kind, i = kind_of(frames), index[sock]
            if kind == Kind.LEASE_GRANT:
                grant = msgpack.unpackb(frames[1].buffer)
                if not grant["leases"]:
                    empty[grant["reason"]] = empty.get(grant["reason"], 0) + 1
                    sock.send_multipart(ask)
                    asked_at[i], queued_at[i] = time.perf_counter(), runqueue_ms()
                    continue
                latencies.append((time.perf_counter() - asked_at[i]) * 1000)
                grants.append((asked_at[i], latencies[-1], runqueue_ms() - queued_at[i]))
                generating.append((time.perf_counter() + generate_s, i, grant["leases"][0]))
            elif kind == Kind.ACK:
                accepted += len(msgpack.unpackb(frames[1].buffer).get("ref_ids") or [None])
            else:
                interval_s = asked_interval(frames, interval_s)
    results.put((grants, accepted, empty, now - start))
    for sock in socks:
        sock.close(0)
    ctx.term()


def learner(endpoint: str, groups_per_step: int, step_s: float, ready: mp.Queue, stop: mp.Event,
            publishes: Path) -> None:
    """A learner whose step takes ``step_s``: it takes a batch, waits, acknowledges it and publishes a tiny
    adapter version, so every connected worker gets one AdapterNotice per step, as in a run; appends each
    publish's perf_counter time (CLOCK_MONOTONIC: comparable across processes) to ``publishes``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    harness.hello(sock, "learner", "scale")
    ready.put("learner")
    version = 0
    sock.send_multipart(codec.encode(BatchRequest(num_groups=groups_per_step, wait_ms=1000)))
    while not stop.is_set():
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart(copy=False)
        if kind_of(frames) != Kind.BATCH:
            continue
        batch = msgpack.unpackb(frames[1].buffer)
        if batch["groups"]:
            time.sleep(step_s)
            version += 1
            end_step(sock, batch, version, version, checkpoint_version=version)
            with publishes.open("a") as out:
                out.write(f"{time.perf_counter()}\n")
        sock.send_multipart(codec.encode(BatchRequest(num_groups=groups_per_step, wait_ms=1000,
                                                         learner_version=version)))
    sock.close(0)
    ctx.term()


def fetchers(endpoint: str, n: int, ready: mp.Queue, results: mp.Queue, stop: mp.Event) -> None:
    """``n`` workers that fetch the adapter each AdapterNotice announces; put the monotonic time each one had
    the whole AdapterUpdate (fetched on notice, one fetch per worker)."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 64)  # a context option (setsockopt would set a socket default)
    socks = connect_workers(ctx, endpoint, [f"fetch-{os.getpid()}-{i}" for i in range(n)])
    ready.put(n)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    fetch = codec.encode(AdapterFetch(version=0))
    done: list[float] = []
    while len(done) < n and not stop.is_set():
        for sock, _ in poller.poll(100):
            frames = sock.recv_multipart(copy=False)
            kind = kind_of(frames)
            if kind == Kind.ADAPTER_NOTICE:
                sock.send_multipart(fetch)
            elif kind == Kind.ADAPTER_UPDATE:
                done.append(time.monotonic())
            del frames  # the 50 MB are dropped at once
    results.put(done)
    for sock in socks:
        sock.close(0)
    ctx.term()


def adapter_message(num_bytes: int) -> tuple[list, int]:
    """(the frames of a version-1 AdapterUpdate of about ``num_bytes``, its exact tensor bytes)."""
    tensors = adapter_tensors(num_bytes)
    update = AdapterUpdate(version=1, step=1, sha256=framing.frames_sha256([t for _, t in tensors]),
                           adapter_config={"r": 8, "lora_alpha": 16, "peft_type": "LORA"})
    return codec.encode(update, tensors), sum(t.nbytes for _, t in tensors)


def publish(endpoint: str, message: list) -> float:
    """Publish ``message`` as the learner; the monotonic time it was sent (after the broker's Welcome)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    harness.hello(sock, "learner", "learner")
    sent = time.monotonic()
    sock.send_multipart(message, copy=False)
    while kind_of(sock.recv_multipart(copy=False)) != Kind.ACK:
        pass
    sock.close(0)
    ctx.term()
    return sent


def workers_counted(endpoint: str) -> int:
    return int(fetch_stats(endpoint, timeout_s=10)["num_workers"])


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1) -> float:
    """Seconds until ``predicate()`` held."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


def broker_cpu(pid: int, seconds: float) -> float:
    """The broker's CPU over ``seconds`` of wall time, as a share of one core."""
    before, start = harness.cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (harness.cpu_seconds(pid) - before) / (time.monotonic() - start)


def heartbeats_in(endpoint: str) -> int:
    return int(fetch_stats(endpoint, timeout_s=10)["messages_in"].get("heartbeat", 0))


def idle_window(pid: int, endpoint: str, seconds: float) -> dict[str, float]:
    """The broker's CPU (all threads; the main thread) as shares of one core over ``seconds``, the heartbeats it
    received per second then, its CPU per heartbeat, and the machine's busy share (of all its cores)."""
    beats_before, threads_before, busy_before = heartbeats_in(endpoint), harness.thread_cpu(pid), harness.machine_busy_ticks()
    start = time.monotonic()
    time.sleep(seconds)
    threads, busy, elapsed = harness.thread_cpu(pid), harness.machine_busy_ticks(), time.monotonic() - start
    beats = (heartbeats_in(endpoint) - beats_before) / elapsed
    total = sum(threads.values()) - sum(threads_before.values())
    return {"idle_core_share": round(total / elapsed, 4),
            "main_thread_share": round((threads["main"] - threads_before["main"]) / elapsed, 4),
            "heartbeats_per_s": round(beats, 1), "us_per_heartbeat": round(total / elapsed / max(beats, 1e-9) * 1e6, 1),
            "machine_busy": round((busy[0] - busy_before[0]) / max(1, busy[1] - busy_before[1]), 3)}


#: run inside a checkout (argv: workers, beats per loop pass): the broker core's CPU per heartbeat, no sockets
CORE_COST = """
import sys, time
from loraflow.broker.core import BrokerCore
from bench.harness import codec
from loraflow.common import protocol
from loraflow.common.config import load_config
from loraflow.common.logging import setup_logging
from loraflow.common.protocol import Heartbeat, Hello
from loraflow.common.tasks import load_task
setup_logging("broker", level="warning")
n, per_pass, counters = int(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3])
config = load_config(None, [f"broker.max_workers={n + 8}"])
core = BrokerCore(config, task=load_task(config.run.task, config.run.seed), now_s=0.0)
ids = [f"worker/w{i}".encode() for i in range(n)]
for i, identity in enumerate(ids):
    core.handle(identity, codec.encode(Hello(role="worker", client_id=f"w{i}", session="s")), 0.0)
core.flush(0.0)
beat = codec.encode(Heartbeat(state="idle", counters=counters))
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
    """The broker core's CPU per heartbeat of an idle worker in ``tree`` (handle + tick + flush every
    ``per_pass`` beats, in-process, no sockets; the best of 4 rounds over ``workers`` peers)."""
    out = subprocess.run([sys.executable, "-c", CORE_COST, str(workers), str(per_pass), repr(IDLE_COUNTERS)],
                         cwd=tree, capture_output=True, text=True, check=True, timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def loop_during(before: dict | None, after: dict | None) -> dict | None:
    """The broker loop's passes between two Stats ``loop`` snapshots (loraflow.broker.stats): how many, their p99
    bucket, how many took over 20 ms, and the slowest pass and step of the broker's last stats window; None for a
    broker without it (an older ``--reference-tree``)."""
    if not before or not after:
        return None
    passes = {k: after["passes"].get(k, 0) - before["passes"].get(k, 0) for k in after["passes"]}
    return {"passes": sum(passes.values()), "p99_ms": pass_quantile(passes, 0.99),
            "over_20ms": sum(v for k, v in passes.items() if k == "inf" or int(k) > 20),
            "slowest_pass_ms": after["slowest_pass_ms"], "slowest_pass_cpu_ms": after["slowest_pass_cpu_ms"],
            "slowest_step": after["slowest_step"], "slowest_gc_ms": after.get("slowest_gc_ms"),
            "gc_collections": {k: v - before.get("gc_collections", {}).get(k, 0)
                               for k, v in after.get("gc_collections", {}).items()},
            "slowest_step_ms": after["slowest_step_ms"]}


def runqueue_ms(pid: int | None = None) -> float:
    """Milliseconds the process's main thread has spent runnable but waiting for a core (/proc schedstat)."""
    with open(f"/proc/{pid or 'self'}/schedstat") as stat:
        return int(stat.read().split()[1]) / 1e6


def tail_causes(grants: list[tuple[float, float, float]], publishes: Path, broker_queued_ms: float,
                elapsed_s: float) -> dict:
    """Where the slow grants (> SLOW_GRANT_MS) wait: the share of them asked for shortly before or during a
    publish (the learner's once-a-second batch, ack and notice fan-out) against that share among all grants,
    and the leasing process's run-queue wait during a slow grant against any grant's."""
    times = sorted(float(line) for line in publishes.read_text().split()) if publishes.exists() else []

    def near_publish(asked: float, latency_ms: float) -> bool:
        got = asked + latency_ms / 1000
        i = bisect.bisect_left(times, asked - NEAR_PUBLISH_S)
        return i < len(times) and times[i] <= got

    slow = [g for g in grants if g[1] > SLOW_GRANT_MS]

    def share(rows: list) -> float:
        return sum(near_publish(asked, latency) for asked, latency, _ in rows) / len(rows) if rows else 0.0
    return {"slow": len(slow), "slow_near_publish": round(share(slow), 3),
            "all_near_publish": round(share(grants), 3),
            "slow_client_queued_ms": round(statistics.median(q for *_, q in slow), 2) if slow else 0.0,
            "all_client_queued_ms": round(statistics.median(q for *_, q in grants), 3) if grants else 0.0,
            "broker_queued_share": round(broker_queued_ms / 1000 / elapsed_s, 4)}


def fleet_sizes(workdir: Path, sizes: list[int], seconds: float, generate_s: float, *, tree: Path = REPO,
                nice: int = 10, label: str = "", overrides: tuple[str, ...] = ()) -> dict[int, dict]:
    """Grow one broker's fleet (at ``nice``) to each size; measure idle CPU, RSS, the active path; kill a fleet at
    the end. ``tree``: the checkout whose broker runs, with these config ``overrides``; ``label`` prefixes its
    lines."""
    spawn = mp.get_context("spawn")
    stop, ready, results = spawn.Event(), spawn.Queue(), spawn.Queue()
    interval, misses = INTERVAL_S, 5  # the broker's defaults (common/config.py)
    workdir.mkdir()
    broker, endpoint = start_broker(workdir, *overrides, f"broker.max_workers={max(sizes) + 2 * ACTIVE_WORKERS + 8}",
                                    f"broker.heartbeat_interval_s={interval}", f"broker.heartbeat_misses={misses}",
                                    "run.group_size=8", f"run.groups_per_step={GROUPS_PER_STEP}",
                                    "run.max_staleness=1000", f"broker.capacity_groups={4 * GROUPS_PER_STEP}",
                                    "broker.max_leases_per_worker=4", tree=tree)
    fleets: list = []
    out: dict[int, dict] = {}
    trainer = None
    try:
        time.sleep(1.0)
        empty_rss = harness.rss_bytes(broker.pid) // 1024
        empty_cpu = broker_cpu(broker.pid, seconds / 2)
        print(f"{label}empty broker: RSS {empty_rss / 1024:.1f} MB, idle CPU {empty_cpu:.1%} of a core", flush=True)
        publishes = workdir / "publishes.txt"
        trainer = spawn.Process(target=learner, args=(endpoint, GROUPS_PER_STEP, STEP_S, ready, stop, publishes))
        trainer.start()
        ready.get(timeout=30)
        connected = 0
        for size in sizes:
            while connected < size:
                n = min(PER_PROCESS, size - connected)
                # each fleet its own stop: SIGKILLed inside is_set(), the victim would leave a shared Event's
                # lock held and the stop.set() below blocked for good
                own_stop = spawn.Event()
                child = spawn.Process(target=fleet, args=(endpoint, f"f{len(fleets)}", n, interval, nice, ready,
                                                          own_stop))
                child.start()
                fleets.append((child, n, own_stop))
                ready.get(timeout=180)
                connected += n
            wait_until(lambda size=size: workers_counted(endpoint) >= size, 60, f"{size} workers counted", poll_s=0.5)
            asked = fetch_stats(endpoint, timeout_s=10)["settings"].get("heartbeat_interval_asked_s", interval)
            time.sleep(asked * 2)  # every worker has beaten at least once (at the interval it is asked for)
            window = {**idle_window(broker.pid, endpoint, seconds), "interval_asked_s": asked}
            idle = window["idle_core_share"]
            rss = harness.rss_bytes(broker.pid) // 1024
            loop_before = fetch_stats(endpoint, timeout_s=10).get("loop")
            worker = spawn.Process(target=active, args=(endpoint, seconds, interval, generate_s, results))
            worker.start()
            busy_before, busy_start = harness.cpu_seconds(broker.pid), time.monotonic()
            broker_queued = runqueue_ms(broker.pid)
            grants, accepted, empty, elapsed = results.get(timeout=seconds + 120)
            broker_queued = runqueue_ms(broker.pid) - broker_queued
            latencies = [latency for _, latency, _ in grants]
            busy = (harness.cpu_seconds(broker.pid) - busy_before) / (time.monotonic() - busy_start)
            # the broker's CPU per group above its idle load: what one core of it can carry at this fleet size
            # (None when the difference drowns in the noise of a busy machine: busy not above idle)
            us_per_group = (busy - idle) / max(accepted / elapsed, 1e-9) * 1e6 if busy > idle else None
            worker.join(10)
            loop = loop_during(loop_before, fetch_stats(endpoint, timeout_s=10).get("loop"))
            p50, p99 = np.percentile(latencies, [50, 99]) if latencies else (float("nan"),) * 2
            out[size] = {**window, "rss_mb": round(rss / 1024, 1),
                         "kb_per_worker": round((rss - empty_rss) / size, 2), "lease_p50_ms": round(float(p50), 2),
                         "lease_p99_ms": round(float(p99), 2), "grants": len(latencies), "empty_grants": empty,
                         "groups_per_s": round(accepted / elapsed, 1), "active_core_share": round(busy, 4),
                         "us_per_group": round(us_per_group, 1) if us_per_group else None,
                         "capacity_groups_per_s": round((1 - idle) / us_per_group * 1e6) if us_per_group else None,
                         "loop": loop, "tail": tail_causes(grants, publishes, broker_queued, elapsed)}
            print(f"{label}{size:>5} workers (asked to beat every {asked:g} s): idle CPU {idle:6.1%} of a core "
                  f"(main thread "
                  f"{window['main_thread_share']:.1%}; {window['heartbeats_per_s']:.0f} heartbeats/s, "
                  f"{window['us_per_heartbeat']:.0f} us each; machine {window['machine_busy']:.0%} busy)  "
                  f"RSS {rss / 1024:7.1f} MB "
                  f"({out[size]['kb_per_worker']:.1f} KB/worker)  lease p50 {p50:6.2f} ms  p99 {p99:6.2f} ms "
                  f"({len(latencies)} grants, empty: {empty or 'none'})  {out[size]['groups_per_s']:.0f} groups/s accepted, broker CPU {busy:.1%} "
                  + (f"({us_per_group:.0f} us per group above idle: one core carries "
                     f"{out[size]['capacity_groups_per_s']} groups/s at this fleet size)" if us_per_group else
                     "(not above idle: too noisy to price a group)"), flush=True)
            tail = out[size]["tail"]
            print(f"{label}       lease tail: {tail['slow']} grants over {SLOW_GRANT_MS} ms; "
                  f"{tail['slow_near_publish']:.0%} of them asked for within {NEAR_PUBLISH_S * 1000:.0f} ms before "
                  f"a publish or while it was sent (all grants: {tail['all_near_publish']:.0%}); the leasing "
                  f"process waited for a core {tail['slow_client_queued_ms']:.1f} ms (median) during a slow grant, "
                  f"{tail['all_client_queued_ms']:.2f} ms during any; the broker's main thread waited for a core "
                  f"{tail['broker_queued_share']:.1%} of the phase", flush=True)
            if loop:
                print(f"{label}       broker loop while active: {loop['passes']} passes, p99 <= {loop['p99_ms']:g} ms, "
                      f"{loop['over_20ms']} over 20 ms; slowest pass {loop['slowest_pass_ms']:.1f} ms (CPU "
                      f"{loop['slowest_pass_cpu_ms']:.1f}), slowest step {loop['slowest_step']} "
                      f"{loop['slowest_step_ms']:.1f} ms, slowest gc {loop['slowest_gc_ms']} ms (last stats window); "
                      f"collections by generation {loop['gc_collections']}", flush=True)
        victim, victim_n, _ = fleets[-1]
        settings = fetch_stats(endpoint, timeout_s=10)["settings"]
        asked = settings.get("heartbeat_interval_asked_s", interval)
        timeout_s = settings.get("heartbeat_timeout_s", interval * misses)
        before = workers_counted(endpoint)
        # workers dropped before the kill: the active workers of the earlier phases (they leave without a Bye),
        # and any live worker a lagging broker heard too late (then the victims cannot all still be counted)
        dead_before = int(fetch_stats(endpoint, timeout_s=10)["peers_gone"].get("dead", 0))
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        death_s = None
        while time.monotonic() - killed < 60:
            if workers_counted(endpoint) <= before - victim_n:
                death_s = time.monotonic() - killed
                break
            time.sleep(0.05)
        expected = ACTIVE_WORKERS * (len(sizes) - 1)
        print(f"{label}death: {victim_n} workers SIGKILLed, " + (
              f"gone from the broker's stats after {death_s:.2f} s" if death_s is not None else
              "NOT all gone from the broker's stats within 60 s") +
              f" (timeout {timeout_s:.1f} s = the interval asked of {before} workers, {asked:g} s, x {misses}; "
              f"configured {interval:g} s); workers dropped as dead "
              f"before the kill: {dead_before} (the active workers of earlier phases: {expected})", flush=True)
        out[max(sizes)]["death_detect_s"] = round(death_s, 2) if death_s is not None else None
        out[max(sizes)]["heartbeat_timeout_s"] = timeout_s
        out[max(sizes)]["dead_before_kill"] = dead_before
        return out
    finally:
        stop.set()
        if trainer is not None:
            trainer.join(timeout=10)
        for child, _, own_stop in fleets:
            if child.is_alive():  # (never the killed one's Event: see above)
                own_stop.set()
        harness.reap([child for child, _, _ in fleets], broker)


def fanout(workdir: Path, counts: list[int], mb: float) -> dict[int, dict]:
    """Time until N fetchers hold one new ``mb`` MB adapter, against one direct send of its bytes."""
    spawn = mp.get_context("spawn")
    out: dict[int, dict] = {}
    message, num_bytes = adapter_message(int(mb * (1 << 20)))
    direct = direct_time(message, repeats=3)
    for count in counts:
        stop, ready, results = spawn.Event(), spawn.Queue(), spawn.Queue()
        (workdir / f"fanout-{count}").mkdir()
        broker, endpoint = start_broker(workdir / f"fanout-{count}", f"broker.max_workers={count + 8}")
        procs = []
        try:
            per = max(1, -(-count // 4))
            left = count
            while left:
                n = min(per, left)
                child = spawn.Process(target=fetchers, args=(endpoint, n, ready, results, stop))
                child.start()
                procs.append(child)
                left -= n
            for _ in procs:
                ready.get(timeout=180)
            sent = publish(endpoint, message)
            done = [t for _ in procs for t in results.get(timeout=600)]
            last = max(done) - sent
            out[count] = {"seconds": round(last, 3), "median_s": round(statistics.median(done) - sent, 3),
                          "broker_bytes_sent": num_bytes * count, "direct_s": round(direct, 4),
                          "ratio_to_direct": round(last / direct, 1), "gb_per_s": round(num_bytes * count / last / 1e9, 2)}
            print(f"fan-out {count:>4} workers x {num_bytes / 1e6:.0f} MB: all hold it after {last:.2f} s (median "
                  f"{out[count]['median_s']:.2f} s); the broker sent {num_bytes * count / 1e9:.1f} GB at "
                  f"{out[count]['gb_per_s']:.2f} GB/s; one direct send {direct:.3f} s -> {last / direct:.0f}x "
                  f"(the star's floor is {count}x)", flush=True)
        finally:
            stop.set()
            harness.reap(procs, broker)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, seconds=10.0)
    parser.add_argument("--fleets", default="256,1024,4096", help="connected workers, comma-separated, ascending")
    parser.add_argument("--generate-ms", type=float, default=100.0, help="active workers: time from a grant to "
                        "its group's submission")
    parser.add_argument("--fanout", default="64,256", help="fetchers for the adapter fan-out ('' for none)")
    parser.add_argument("--mb", type=float, default=50.0, help="adapter size for the fan-out")
    parser.add_argument("--fleet-nice", type=int, default=10, help="niceness of the fleet processes (0: they "
                        "compete with the broker for this machine's cores, the earlier method)")
    parser.add_argument("--reference-tree", type=Path, default=None, help="another checkout whose broker is "
                        "measured first, with the same clients (the before of a before/after)")
    parser.add_argument("--unlimited-reference", action="store_true", help="measure this broker first with no "
                        "heartbeat budget (broker.max_heartbeats_per_second=0: every worker beats every second), "
                        "then with the configured one")
    parser.add_argument("--budget", type=float, default=None, help="broker.max_heartbeats_per_second of the "
                        "measured broker (default: the config's)")
    args = harness.parse(parser, argv, fleets="16", seconds=0.5, fanout="2", mb=1.0)
    budget = () if args.budget is None else (f"broker.max_heartbeats_per_second={args.budget}",)
    sizes = sorted(int(s) for s in args.fleets.split(","))
    print(f"machine load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; fleet at nice "
          f"{args.fleet_nice}", flush=True)
    before: dict[int, dict] = {}
    core_us = {"after": core_cost(REPO, max(sizes))}
    if args.reference_tree is not None:
        core_us["before"] = core_cost(args.reference_tree.resolve(), max(sizes))
    print(f"broker core alone (in-process, no sockets, CPU time) per idle worker's heartbeat at {max(sizes)} "
          f"workers: " + (f"before {core_us['before']:.1f} us -> " if "before" in core_us else "") +
          f"{core_us['after']:.1f} us", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=Path(__file__).resolve().parent.parent) as tmp:
        if args.reference_tree is not None:
            before = fleet_sizes(Path(tmp) / "before", sizes, args.seconds, args.generate_ms / 1000,
                                 tree=args.reference_tree.resolve(), nice=args.fleet_nice, label="before: ")
        elif args.unlimited_reference:
            before = fleet_sizes(Path(tmp) / "before", sizes, args.seconds, args.generate_ms / 1000,
                                 nice=args.fleet_nice, label="no budget: ",
                                 overrides=("broker.max_heartbeats_per_second=0",))
        scale = fleet_sizes(Path(tmp) / "fleet", sizes, args.seconds, args.generate_ms / 1000, nice=args.fleet_nice,
                            label="after:  " if before else "", overrides=budget)
        fan = fanout(Path(tmp), [int(c) for c in args.fanout.split(",") if c], args.mb) if args.fanout else {}
    for size in sizes if before else ():
        b, a = before[size], scale[size]
        print(f"{size:>5} workers, before -> after: idle {b['idle_core_share']:.1%} -> {a['idle_core_share']:.1%} "
              f"of a core ({b['us_per_heartbeat']:.0f} -> {a['us_per_heartbeat']:.0f} us per heartbeat), lease p50 "
              f"{b['lease_p50_ms']:.1f} -> {a['lease_p50_ms']:.1f} ms, p99 {b['lease_p99_ms']:.1f} -> "
              f"{a['lease_p99_ms']:.1f} ms, {b['kb_per_worker']:.0f} -> {a['kb_per_worker']:.0f} KB/worker, "
              f"interval asked {b.get('interval_asked_s', 1.0):g} -> {a['interval_asked_s']:g} s", flush=True)
    print(f"machine load at the end {os.getloadavg()[0]:.2f}", flush=True)
    top = scale[max(sizes)]
    group_tokens = GROUP_BYTES / WIRE_BYTES_PER_TOKEN
    capacity = top["capacity_groups_per_s"]
    h100s = capacity * group_tokens / H100_TOKENS_PER_S if capacity else None
    if capacity:
        print(f"as a fleet: with {max(sizes)} workers connected one broker core carries {capacity} groups/s of 16 KB "
              f"= {capacity * GROUP_BYTES / 1e6:.0f} MB/s of tokens ({WIRE_BYTES_PER_TOKEN} B per token on the wire): "
              f"what {h100s:.0f} H100s generating a 7 B model at {H100_TOKENS_PER_S} tokens/s each produce", flush=True)
    print(f"targets at {max(sizes)} workers: idle {top['idle_core_share']:.1%} of a core (<= 25 %), lease p99 "
          f"{top['lease_p99_ms']:.1f} ms (<= 20 ms), {top['kb_per_worker']:.1f} KB per worker", flush=True)
    report("broker_scale", f"broker idle CPU at {max(sizes)} workers (share of one core)", top["idle_core_share"],
           "cores", 0.25, idle_core_share=top["idle_core_share"], lease_p99_ms=top["lease_p99_ms"],
           kb_per_worker=top["kb_per_worker"], death_detect_s=top.get("death_detect_s"),
           heartbeat_timeout_s=top.get("heartbeat_timeout_s"), h100_equivalent=round(h100s) if h100s else None,
           fleet_nice=args.fleet_nice, core_us_per_heartbeat=core_us, by_fleet={str(k): v for k, v in scale.items()},
           before={str(k): v for k, v in before.items()}, fanout={str(k): v for k, v in fan.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
