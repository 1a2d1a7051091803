"""A large fleet's costs: the heartbeat fast path (broker/heartbeats.py), the O(expired) liveness sweep and
indexed registry (broker/peers.py), and a publish's notices spread over loop passes (broker/core.py).

The fast path must accept exactly what the general path accepts and leave the same state and counters: each case
below is sent to two cores, one with the fast path and one without, and their replies, peers and stats compared.
"""

from __future__ import annotations

import math
import threading
import time

import msgpack
import pytest
import zmq

from loraflow.broker import server as server_module
from loraflow.broker.adapters import NOTICE_BATCH, NOTICE_SPACING_S
from loraflow.broker.core import BrokerCore
from loraflow.broker.peers import PeerRegistry
from loraflow.broker.server import BrokerServer
from loraflow.common import codec, framing, protocol, sockets
from loraflow.common.config import load_config
from loraflow.common.protocol import Heartbeat, Hello, Kind, LeaseRequest, LeaseReturn
from loraflow.common.tasks import load_task
from tests.broker.clients import make_adapter
from tests.broker.harness import LEARNER, W1, Harness

PREAMBLE = framing.PREAMBLE.pack(framing.MAGIC, protocol.PROTOCOL_VERSION, Kind.HEARTBEAT)
WORKER_COUNTERS = {"groups_submitted": 12, "tokens_generated": 98765, "reward_failures": 0, "adapters_received": 3,
                   "unacked": 1}


def raw_beat(**fields: object) -> list[bytes]:
    """A heartbeat as any msgpack client could send it (no loraflow encoder: bad values travel too)."""
    return [PREAMBLE, msgpack.packb(fields)]


CASES = {
    "empty": [raw_beat()],
    "worker": [raw_beat(state="generating", adapter_version=0, num_leases=1, counters=WORKER_COUNTERS)],
    "same_counters_twice": [raw_beat(counters=WORKER_COUNTERS), raw_beat(counters=WORKER_COUNTERS, state="scoring")],
    "counters_change": [raw_beat(counters={"a": 1}), raw_beat(counters={"a": 2, "b": 0.5})],
    "too_many_counters": [raw_beat(counters={"a": 1}), raw_beat(counters={f"c{i}": i for i in range(65)})],
    "counter_name_too_long": [raw_beat(counters={"x" * 65: 1})],
    "counter_not_a_number": [raw_beat(counters={"a": 1}), raw_beat(counters={"a": "many"})],
    "counter_nan": [raw_beat(counters={"a": math.nan})],
    "counter_nested": [raw_beat(counters={"a": {"b": 1}})],
    "counters_not_a_map": [raw_beat(counters=[1, 2])],
    "unknown_field": [raw_beat(counters={"a": 1}, future_field=3), raw_beat(counters={"a": 1})],
    "bad_state": [raw_beat(state="dreaming")],
    "negative_version": [raw_beat(adapter_version=-1)],
    "tensors": [raw_beat(tensors=[{"name": "t", "dtype": "uint8", "shape": [1], "frame": 0}])],
    "empty_tensors": [raw_beat(tensors=[])],
    "extra_frame": [[*raw_beat(), b"x"]],
    "not_msgpack": [[PREAMBLE, b"\xc1\xc1"]],
    "not_a_map": [[PREAMBLE, msgpack.packb([1, 2])]],
    "lease_ids": [raw_beat(lease_ids=["nope"] * 3)],
}


def observed(harness: Harness, frames_list: list[list[bytes]]) -> list:
    out = []
    for frames in frames_list:
        replies = harness.send_frames(W1, frames)
        peer = harness.core.peers.get(W1)
        out.append(([(i, type(r).__name__, r) for i, r, _ in replies],
                    (peer.state, peer.adapter_version, peer.num_leases_reported, peer.counters) if peer else None))
    stats = harness.stats()
    out.append({k: stats[k] for k in ("messages_in", "messages_out", "bytes_in", "bytes_out", "rejected",
                                      "unknown_fields", "lease_events")})
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_path_accepts_and_refuses_as_the_general_path(case: str) -> None:
    fast, general = Harness(), Harness()
    general.core._beats.decode = lambda *_args: None  # every heartbeat through the general path
    for harness in (fast, general):
        harness.hello(W1)
    assert observed(fast, CASES[case]) == observed(general, CASES[case])


def test_bad_counters_are_refused_and_counted_after_good_ones() -> None:
    harness = Harness()
    harness.hello(W1)
    harness.send_frames(W1, raw_beat(counters={"a": 1}))
    replies = harness.send_frames(W1, raw_beat(counters={"a": 1, **{f"c{i}": i for i in range(64)}}))
    assert [r.code for _, r, _ in replies] == ["malformed"] and "Heartbeat.counters" in replies[0][1].message
    assert harness.core.peers.get(W1).counters == {"a": 1}  # the refused beat changed nothing
    assert harness.stats()["rejected"] == {"malformed": 1}


def test_counters_kept_by_the_general_path_are_not_mistaken_for_unchanged() -> None:
    """fast {a: 1}, then a general-path beat {a: 2} (it has an unknown field), then {a: 1} again: the last wins."""
    harness = Harness()
    harness.hello(W1)
    harness.send_frames(W1, raw_beat(counters={"a": 1}))
    harness.send_frames(W1, raw_beat(counters={"a": 2}, future_field=1))
    assert harness.core.peers.get(W1).counters == {"a": 2}
    harness.send_frames(W1, raw_beat(counters={"a": 1}))
    assert harness.core.peers.get(W1).counters == {"a": 1}
    assert harness.stats()["unknown_fields"] == {"heartbeat": 1}


def test_pong_carries_the_latest_version_after_a_publish() -> None:
    harness = Harness()
    harness.hello(W1)
    harness.hello(b"learner/learner")
    pongs = [r for i, r, _ in harness.send_frames(W1, raw_beat()) if isinstance(r, Heartbeat)]
    assert [p.latest_version for p in pongs] == [0]
    harness.publish(1)
    pongs = [r for i, r, _ in harness.send_frames(W1, raw_beat()) if isinstance(r, Heartbeat)]
    assert [p.latest_version for p in pongs] == [1]


def test_a_beat_reconsiders_parked_requests_only_when_the_version_changes() -> None:
    harness = Harness()
    harness.hello(W1)
    harness.send_frames(W1, raw_beat(adapter_version=0))
    harness.core.handle(W1, raw_beat(adapter_version=0), harness.now)
    assert not harness.core._reconsider
    harness.core.handle(W1, raw_beat(adapter_version=1), harness.now)
    assert harness.core._reconsider
    harness.flush()


def test_a_parked_lease_request_is_still_answered_while_beats_arrive() -> None:
    harness = Harness("broker.capacity_groups=2", "broker.max_leases_per_worker=2")
    harness.hello(W1)
    harness.hello(b"worker/w2")
    held = harness.lease(b"worker/w2", n=2)  # all the credit
    assert len(held) == 2
    replies = harness.send(W1, LeaseRequest(max_leases=1, wait_ms=5000))
    assert not [r for i, r, _ in replies if r.KIND == Kind.LEASE_GRANT]
    for _ in range(3):
        replies = harness.send_frames(W1, raw_beat())
        assert [type(r).__name__ for _, r, _ in replies] == ["Heartbeat"]
    replies = harness.send(b"worker/w2", LeaseReturn(lease_ids=[held[0].lease_id]))
    grants = [r for i, r, _ in replies if i == W1 and r.KIND == Kind.LEASE_GRANT]
    assert len(grants) == 1 and len(grants[0].leases) == 1


# -- liveness ------------------------------------------------------------------------------------------------


def registry(n: int) -> PeerRegistry:
    peers = PeerRegistry(heartbeat_interval_s=1.0, heartbeat_misses=3, max_workers=n)
    for i in range(n):
        peers.hello(f"worker/w{i}".encode(), Hello(role="worker", client_id=f"w{i}", session="s"), 0.0)
    return peers


def test_the_sweep_finds_exactly_the_silent_peers_in_any_order() -> None:
    peers = registry(6)
    for now_s, i in [(1.0, 4), (1.5, 0), (2.0, 2), (2.5, 4)]:
        peers.heard(f"worker/w{i}".encode(), now_s)
    assert peers.dead(3.0) == []
    assert sorted(p.client_id for p in peers.dead(3.01)) == ["w1", "w3", "w5"]  # silent since 0.0
    assert [p.client_id for p in peers.dead(4.51)] == ["w0"]
    assert [p.client_id for p in peers.dead(5.01)] == ["w2"]
    assert [p.client_id for p in peers.all()] == ["w4"] and peers.num_workers() == 1


def test_the_sweep_reads_only_the_expired_peers() -> None:
    peers = registry(1000)
    for i in range(1, 1000):
        peers.heard(f"worker/w{i}".encode(), 2.0)
    read = []
    original = peers._peers.__class__.__getitem__

    class Counting(dict):
        def __getitem__(self, key: bytes) -> object:
            read.append(key)
            return original(self, key)

    peers._peers = Counting(peers._peers)
    assert [p.client_id for p in peers.dead(3.5)] == ["w0"]
    assert len(read) <= 2  # the silent one, then the first live one ends the sweep


def test_death_detected_on_time_through_the_core() -> None:
    harness = Harness("broker.heartbeat_misses=3")
    harness.hello(W1)
    harness.hello(b"worker/w2")
    for _ in range(4):
        harness.advance(1.0)
        harness.send_frames(b"worker/w2", raw_beat())
    assert harness.stats()["num_workers"] == 1  # w1 silent 4 s > 3 s: gone within a sweep (0.5 s)
    assert harness.stats()["peers_gone"] == {"dead": 1}


def test_registry_index_follows_restarts_and_removals() -> None:
    peers = registry(3)
    peer, old = peers.hello(b"worker/w1", Hello(role="worker", client_id="w1", session="s2"), 1.0)
    assert old is not None and old.session == "s" and peers.worker("w1", "s2") is peer
    assert peers.worker("w1", "s") is None and peers.num_workers() == 3
    moved, old = peers.hello(b"worker/w1-route", Hello(role="worker", client_id="w1", session="s3"), 2.0)
    assert old is peer and peers.get(b"worker/w1") is None and peers.worker("w1", "s3") is moved
    peers.remove(b"worker/w1-route")
    assert peers.worker("w1", "s3") is None and peers.num_workers() == 2 and len(peers.of_role("worker")) == 2


# -- notices spread over passes ------------------------------------------------------------------------------


def test_a_publish_to_many_workers_is_paced_in_batches_behind_other_replies() -> None:
    n = 4 * NOTICE_BATCH + 17
    harness = Harness(f"broker.max_workers={n}")
    workers = [f"worker/w{i}".encode() for i in range(n)]
    for identity in workers:
        harness.hello(identity)
    harness.hello(LEARNER)
    core, now = harness.core, harness.now
    record, tensors = make_adapter(1)
    core.handle(LEARNER, codec.encode(record, tensors), now)
    core.handle(workers[5], codec.encode(LeaseRequest(max_leases=1, adapter_version=1, wait_ms=0)), now)
    notices: dict[bytes, int] = {}
    passes = []
    while core.has_work(now) or len(core.notices) or not passes:
        if not core.has_work(now):  # only notices left: the next batch is due NOTICE_SPACING_S after the last
            assert core.next_wakeup_s(now) == pytest.approx(now + NOTICE_SPACING_S)
            assert not [o for o in core.flush(now) if o.kind == Kind.ADAPTER_NOTICE]  # not before then
            now += NOTICE_SPACING_S
        core.tick(now)
        out = core.flush(now)
        kinds = [o.kind for o in out]
        passes.append(kinds)
        assert kinds.count(Kind.ADAPTER_NOTICE) <= NOTICE_BATCH
        for o in out:
            if o.kind == Kind.ADAPTER_NOTICE:
                notices[o.identity] = notices.get(o.identity, 0) + 1
                assert codec.decode(o.frames)[0].version == 1
        assert len(passes) < 20
    assert Kind.LEASE_GRANT in passes[0] and passes[0].index(Kind.LEASE_GRANT) < passes[0].index(Kind.ADAPTER_NOTICE)
    assert notices == {identity: 1 for identity in workers}  # each worker once
    assert len([p for p in passes if Kind.ADAPTER_NOTICE in p]) == 5  # 4 x 128 + 17 in batches of 128
    assert harness.stats()["messages_out"]["adapter_notice"] == n


def test_notices_not_yet_sent_go_out_when_draining() -> None:
    n = NOTICE_BATCH + 5
    harness = Harness(f"broker.max_workers={n}")
    for i in range(n):
        harness.hello(f"worker/w{i}".encode())
    harness.hello(LEARNER)
    record, tensors = make_adapter(1)
    harness.core.handle(LEARNER, codec.encode(record, tensors), harness.now)
    harness.core.tick(harness.now)
    first = [o for o in harness.core.flush(harness.now) if o.kind == Kind.ADAPTER_NOTICE]
    rest = [o for o in harness.core.drain(harness.now) if o.kind == Kind.ADAPTER_NOTICE]
    assert len(first) == NOTICE_BATCH and len(first) + len(rest) == n
    assert {o.identity for o in first} | {o.identity for o in rest} == {f"worker/w{i}".encode() for i in range(n)}


# -- the loop's bounded drain --------------------------------------------------------------------------------


def test_a_pass_stops_receiving_at_its_time_bound_and_the_rest_is_served_next(monkeypatch) -> None:
    """MAX_DRAIN_S = 0: every pass handles one message, then sends and polls again; a burst of heartbeats and
    the LeaseRequest behind it are all answered."""
    monkeypatch.setattr(server_module, "MAX_DRAIN_S", 0.0)
    config = load_config(None, ["broker.bind=tcp://127.0.0.1:0", "run.group_size=2"])
    core = BrokerCore(config, task=load_task(config.run.task, config.run.seed), vocab_size=200)
    handled: list[int] = [0]
    per_pass: list[int] = []
    handle, flush = core.handle, core.flush

    def counting_handle(*args, **kwargs):
        handled[0] += 1
        return handle(*args, **kwargs)

    def counting_flush(now_s):
        per_pass.append(handled[0])
        handled[0] = 0
        return flush(now_s)

    monkeypatch.setattr(core, "handle", counting_handle)
    monkeypatch.setattr(core, "flush", counting_flush)
    ctx = zmq.Context()
    server = BrokerServer(config, core, ctx=ctx)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    sock = sockets.dealer_socket(ctx, server.endpoint, identity=W1)
    try:
        sock.send_multipart(codec.encode(Hello(role="worker", client_id="w1", session="s1")))
        assert sock.poll(20_000) and codec.decode(sock.recv_multipart())[0].KIND == Kind.WELCOME
        for _ in range(50):
            sock.send_multipart(raw_beat())
        sock.send_multipart(codec.encode(LeaseRequest(max_leases=1, wait_ms=0)))
        kinds: list[int] = []
        while Kind.LEASE_GRANT not in kinds and sock.poll(20_000):
            kinds.append(codec.decode(sock.recv_multipart())[0].KIND)
        assert kinds.count(Kind.HEARTBEAT) == 50 and kinds[-1] == Kind.LEASE_GRANT
    finally:
        sock.close(linger=0)
        server.stop()
        thread.join(timeout=30)
        ctx.term()
    assert not thread.is_alive() and sum(per_pass) >= 52 and max(per_pass) == 1


def test_beats_are_answered_often_enough_for_the_clients_silence_timeout() -> None:
    """A client that says it re-hellos after 3 s of silence is answered once per second of beats (a third of its
    timeout), however often it beats; one that says nothing is answered at every beat."""
    harness = Harness()
    harness.send(W1, Hello(role="worker", client_id="w1", session="s1", silence_timeout_s=3.0))
    harness.hello(b"worker/w2")
    answered: dict[bytes, list[float]] = {W1: [], b"worker/w2": []}
    start = harness.now
    for _ in range(9):  # a beat every 0.5 s for 4 s
        for identity in answered:
            if any(isinstance(r, Heartbeat) and i == identity for i, r, _ in harness.send_frames(identity, raw_beat())):
                answered[identity].append(harness.now - start)
        harness.advance(0.5)
    assert answered[W1] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert answered[b"worker/w2"] == [0.5 * i for i in range(9)]


def test_a_real_link_with_thinned_pongs_never_rejoins(procs) -> None:
    """A real broker process and a real client link at the same settings (beats every 0.25 s, 12 misses: a 3-s
    timeout, roomy on a loaded machine): the broker answers about every fourth beat, the link hears it well inside
    its timeout and never says hello again."""
    from loraflow.common.transport import BrokerLink, fetch_stats
    from tests.support import start_broker, wait_for

    broker = start_broker(procs, "broker.heartbeat_interval_s=0.25", "broker.heartbeat_misses=12")
    link = BrokerLink(broker.endpoint, Hello(role="worker", client_id="w1"), heartbeat_interval_s=0.25,
                      heartbeat_timeout_s=3.0)
    try:
        link.start(20)
        wait_for(lambda: fetch_stats(broker.endpoint)["messages_in"].get("heartbeat", 0) >= 24, 60,
                 "24 heartbeats at the broker", procs)
        stats = fetch_stats(broker.endpoint)
        beats, pongs = stats["messages_in"]["heartbeat"], stats["messages_out"].get("heartbeat", 0)
        assert 0 < pongs < 0.6 * beats
        assert link.num_reconnects == 0 and [w["id"] for w in stats["workers"]] == ["w1"]
    finally:
        link.close()


# -- the heartbeat budget (broker.max_heartbeats_per_second) ---------------------------------------------------


def test_the_asked_interval_stretches_with_the_fleet_and_death_waits_for_it() -> None:
    peers = PeerRegistry(heartbeat_interval_s=1.0, heartbeat_misses=3, max_workers=100, max_heartbeats_per_second=10)

    def join(first: int, last: int) -> None:
        for i in range(first, last):
            peers.hello(f"worker/w{i}".encode(), Hello(role="worker", client_id=f"w{i}", session="s"), 0.0)

    join(0, 10)
    assert not peers.pace(0.0) and (peers.interval_s, peers.timeout_s) == (1.0, 3.0)  # 10 beats/s: in budget
    join(10, 25)
    assert peers.pace(0.0) and (peers.interval_s, peers.timeout_s) == (2.5, 7.5)  # 25 / 10 per s
    join(25, 26)
    assert peers.pace(0.0) and peers.interval_s == 2.75  # rounded up to a quarter of the configured interval
    peers.remove(b"worker/w25")
    assert not peers.pace(0.0) and peers.interval_s == 2.75  # a fleet at a step's edge does not flap
    for i in range(5, 25):
        peers.remove(f"worker/w{i}".encode())
    for i in range(5):
        peers.heard(f"worker/w{i}".encode(), 10.0)
    assert peers.pace(10.0) and peers.interval_s == 1.0
    assert peers.timeout_s == 8.25  # kept until every follower has heard the shorter interval
    assert peers.dead(18.0) == []  # silent 8 s: beating at the old 2.75 s, three of them missed at most
    peers.pace(18.3)
    assert peers.timeout_s == 3.0 and len(peers.dead(18.3)) == 5


def test_the_welcome_and_the_pongs_ask_for_the_interval_and_followers_are_answered_less_often() -> None:
    """A budget of two beats a second: three clients are asked for 1.5 s (in their Welcome), four for 2 s. A
    follower (it said its own interval) that waits 3 s for an answer waits 6 s now, so it is answered every 2 s
    of beats; an older client (no interval in its Hello) keeps its own interval and timeout and is answered as
    before."""
    harness = Harness("broker.max_heartbeats_per_second=2", "broker.heartbeat_misses=5")
    harness.send(W1, Hello(role="worker", client_id="w1", session="s1", silence_timeout_s=3.0,
                           heartbeat_interval_s=1.0))
    harness.send(b"worker/w2", Hello(role="worker", client_id="w2", session="s1", silence_timeout_s=3.0))
    harness.hello(b"worker/w3")
    harness.advance(1.0)  # a liveness sweep sets the interval for the fleet
    welcome = next(r for i, r, _ in harness.hello(b"worker/w4") if isinstance(r, protocol.Welcome))
    assert (welcome.heartbeat_interval_s, welcome.heartbeat_timeout_s) == (1.5, 7.5)
    harness.advance(1.0)
    settings = harness.stats()["settings"]
    assert (settings["heartbeat_interval_asked_s"], settings["heartbeat_timeout_s"]) == (2.0, 10.0)
    answered: dict[bytes, list[float]] = {W1: [], b"worker/w2": []}
    start = harness.now
    for _ in range(9):  # a beat every second for 8 s (the follower would beat every 2 s; faster is allowed)
        for identity in answered:
            pongs = [r for i, r, _ in harness.send_frames(identity, raw_beat()) if isinstance(r, Heartbeat)
                     and i == identity]
            if pongs:
                assert pongs[0].interval_s == harness.stats()["settings"]["heartbeat_interval_asked_s"]
                answered[identity].append(harness.now - start)
        harness.advance(1.0)
    assert answered[W1] == [0.0, 2.0, 4.0, 6.0, 8.0]  # a third of 3 s x (2 s / 1 s)
    assert answered[b"worker/w2"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # a third of its own 3 s


def test_real_links_follow_the_interval_the_broker_asks_for(procs) -> None:
    """A real broker process whose budget is 2 beats a second and three real links configured to beat every 0.25 s
    (8 misses: 2 s): the broker asks for 1.5 s; the links beat at it (far fewer beats than 12 a second), never
    rejoin, and are never declared dead although they are silent 6x their own timeout's interval."""
    from loraflow.common.transport import BrokerLink, fetch_stats
    from tests.support import start_broker, wait_for

    broker = start_broker(procs, "broker.heartbeat_interval_s=0.25", "broker.heartbeat_misses=8",
                          "broker.max_heartbeats_per_second=2")
    links = [BrokerLink(broker.endpoint, Hello(role="worker", client_id=f"w{i}"), heartbeat_interval_s=0.25,
                        heartbeat_timeout_s=2.0) for i in range(3)]
    try:
        for link in links:
            link.start(20)
        wait_for(lambda: all(link.heartbeat_interval_s == 1.5 for link in links), 30, "the links follow 1.5 s",
                 procs)
        first = fetch_stats(broker.endpoint)
        assert first["settings"]["heartbeat_interval_asked_s"] == 1.5 and first["settings"]["heartbeat_timeout_s"] == 12
        time.sleep(6.0)
        last = fetch_stats(broker.endpoint)
        beats = last["messages_in"]["heartbeat"] - first["messages_in"]["heartbeat"]
        assert 6 <= beats <= 18  # 3 links x 6 s / 1.5 s = 12 (at their own 0.25 s: 72)
        assert all(link.num_reconnects == 0 for link in links)
        assert sorted(w["id"] for w in last["workers"]) == ["w0", "w1", "w2"] and not last["peers_gone"]
    finally:
        for link in links:
            link.close()


def test_a_stop_before_the_loop_starts_is_kept() -> None:
    """A SIGTERM between the handler's install and serve() (loraflow.broker.main collects garbage there) stops the
    broker: serve() returns at once instead of running until it is killed."""
    config = load_config(None, ["broker.bind=tcp://127.0.0.1:0", "run.group_size=2"])
    core = BrokerCore(config, task=load_task(config.run.task, config.run.seed), vocab_size=200)
    ctx = zmq.Context()
    server = BrokerServer(config, core, ctx=ctx)
    server.stop()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    thread.join(timeout=10)
    try:
        assert not thread.is_alive()
    finally:
        ctx.term()
