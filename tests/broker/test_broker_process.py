"""The broker as a real process on loopback, driven by scripted workers and learners over BrokerLink.

Short heartbeats and lease timeouts (via --set) keep each test to a few seconds; every wait is bounded.
"""

from __future__ import annotations

import hashlib
import signal
import socket
import urllib.request

import numpy as np
import pytest
import zmq

from loraflow.common import codec, sockets
from loraflow.common.protocol import Hello, Kind, LeaseRequest
from tests.broker.clients import Learner, Worker, adapter_tensors
from tests.support import Processes, start_broker, wait_for

FAST = ("broker.heartbeat_interval_s=0.2", "broker.heartbeat_misses=5", "run.group_size=2", "run.groups_per_step=2")


def counter(stats: dict, family: str, key: str) -> int:
    return stats.get(family, {}).get(key, 0)


def test_backpressure_blocks_a_producer_until_the_learner_acks(procs: Processes) -> None:
    broker = start_broker(procs, *FAST, "run.max_staleness=3", "broker.capacity_groups=2")
    worker, learner = Worker(broker.endpoint, "w1"), Learner(broker.endpoint, token=broker.run_token)
    try:
        grant = worker.lease(10)
        assert len(grant.leases) == 2 and grant.reason == "backpressure"
        for lease in grant.leases:
            worker.submit(lease)
            assert worker.reply().status == "accepted"
        worker.request(2, wait_ms=20_000)  # parks: capacity is full
        worker.nothing(Kind.LEASE_GRANT, timeout_s=0.5)
        batch = learner.batch(2).record
        worker.nothing(Kind.LEASE_GRANT, timeout_s=0.5)  # served groups still hold their slots until acked
        assert broker.stats()["waiting"]["lease_requests"] == 1
        assert learner.ack(batch).ref_id == batch.batch_id
        resumed = worker.expect(Kind.LEASE_GRANT, timeout_s=5).record
        assert [lease.group_id for lease in resumed.leases] == ["0:2", "0:3"]
    finally:
        worker.close()
        learner.close()


def test_lease_expiry_requeues_and_late_group_wins(procs: Processes) -> None:
    broker = start_broker(procs, *FAST, "broker.lease_timeout_s=0.5")
    slow, fast = Worker(broker.endpoint, "slow"), Worker(broker.endpoint, "fast")
    try:
        old, = slow.lease(1).leases
        wait_for(lambda: counter(broker.stats(), "lease_events", "expired") == 1, 5, "the lease to expire", procs)
        assert broker.stats()["prompts"]["queued"] == 1
        new, = fast.lease(1).leases
        assert new.group_id == old.group_id and new.lease_id != old.lease_id
        slow.submit(old)
        assert slow.reply().status == "accepted"  # expired, but not buffered yet: accepted
        slow.submit(old)
        assert slow.reply().status == "duplicate"  # a re-send is deduplicated
        fast.submit(new)
        assert fast.reply().status == "duplicate"
        stats = broker.stats()
        assert stats["lease_events"]["cancelled"] == 1 and stats["group_events"] == {"accepted": 1, "duplicate": 2}
    finally:
        slow.close()
        fast.close()


def test_stale_groups_are_dropped_and_their_prompts_requeued(procs: Processes) -> None:
    broker = start_broker(procs, *FAST, "run.max_staleness=1")
    worker, learner = Worker(broker.endpoint, "w1"), Learner(broker.endpoint, token=broker.run_token)
    try:
        for lease in worker.lease(2).leases:
            worker.submit(lease)
            assert worker.reply().status == "accepted"
        for version in (1, 2):
            assert learner.publish(version).ref_id == str(version)
        assert learner.batch(2, wait_ms=300).record.groups == []  # both groups are 2 versions old
        stats = broker.stats()
        assert stats["dropped"] == {"stale": 2} and stats["prompts"]["queued"] == 2
        assert worker.lease(1).reason == "stale_adapter"
        update = worker.fetch()
        assert update.record.version == 2
        worker.adapter_version = 2
        assert [lease.group_id for lease in worker.lease(2).leases] == ["0:0", "0:1"]
    finally:
        worker.close()
        learner.close()


def test_adapter_relay_to_several_workers_and_a_late_joiner(procs: Processes) -> None:
    broker = start_broker(procs, *FAST)
    workers = [Worker(broker.endpoint, f"w{i}") for i in range(3)]
    learner = Learner(broker.endpoint, token=broker.run_token)
    tensors = adapter_tensors(num_floats=1 << 18, seed=7)  # 1 MB
    digest = hashlib.sha256(b"".join(t.tobytes() for _, t in tensors)).hexdigest()
    late = None
    try:
        assert learner.publish(1, tensors).KIND == Kind.ACK
        for worker in workers:
            assert worker.expect(Kind.ADAPTER_NOTICE).record.version == 1
            update = worker.fetch()
            got = b"".join(bytes(f.buffer) for f in update.envelope.frames)
            assert update.record.sha256 == digest and hashlib.sha256(got).hexdigest() == digest
        late = Worker(broker.endpoint, "late")
        assert late.expect(Kind.ADAPTER_NOTICE).record.version == 1  # right after its Welcome: a notice
        update = late.fetch()  # ... and the tensors when it asks
        assert update.record.version == 1
        assert np.array_equal(np.frombuffer(update.envelope.frames[0].buffer, dtype=np.float32), tensors[0][1])
        assert broker.stats()["bytes_out"] > 4 * (1 << 20)
    finally:
        for worker in [*workers, late]:
            if worker is not None:
                worker.close()
        learner.close()


def test_restart_continues_the_cursor_nothing_lost_nothing_twice(procs: Processes) -> None:
    settings = (*FAST, "run.max_staleness=3", "broker.capacity_groups=8", "broker.prompt_limit=8",
                "broker.num_epochs=1")
    broker = start_broker(procs, *settings)
    worker, learner = Worker(broker.endpoint, "w1"), Learner(broker.endpoint, token=broker.run_token)
    confirmed: list[str] = []
    try:
        leases = worker.lease(6).leases
        assert [lease.group_id for lease in leases] == [f"0:{i}" for i in range(6)]
        for lease in leases[:4]:
            worker.submit(lease)
            assert worker.reply().status == "accepted"
        first = learner.batch(2).record
        learner.ack(first)
        confirmed += [e.group.group_id for e in first.groups]
        second = learner.batch(2).record  # in training when the broker dies
        assert learner.publish(1).KIND == Kind.ACK
        broker.proc.kill()
        broker = start_broker(procs, *settings, f'broker.bind="{broker.endpoint}"', run_dir=broker.run_dir,
                              name="broker2")  # same port: the clients reconnect by themselves
        assert worker.expect_reconnected().welcome.broker_id != first.batch_id.split(".")[0]
        learner.expect_reconnected()
        ack = learner.ack(second)  # a batch the new broker never served: trained by group ids
        assert ack.KIND == Kind.ACK
        confirmed += [e.group.group_id for e in second.groups]
        worker.submit(leases[4])  # generated under a lease of the dead broker: its prompt was re-queued
        assert worker.reply().status == "accepted"
        worker.submit(leases[0])  # trained before the crash
        assert worker.reply().status == "duplicate"
        rest = worker.lease(8).leases
        assert [lease.group_id for lease in rest] == ["0:5", "0:6", "0:7"]  # re-queued first, then new
        for lease in rest:
            worker.submit(lease)
            assert worker.reply().status == "accepted"
        for _ in range(2):
            batch = learner.batch(2).record
            learner.ack(batch)
            confirmed += [e.group.group_id for e in batch.groups]
        assert sorted(confirmed) == [f"0:{i}" for i in range(8)]
        late = Worker(broker.endpoint, "late")
        assert late.expect(Kind.ADAPTER_NOTICE).record.version == 1
        assert late.fetch().record.version == 1  # the adapter survived the crash too
        late.close()
        stats = broker.stats()
        assert stats["prompts"]["exhausted"] and stats["prompts"]["trained_total"] == 8  # persisted across
        assert worker.lease(1).reason == "no_prompts"
        assert broker.proc.stop() == 0  # SIGTERM: clean exit
    finally:
        worker.close()
        learner.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_metrics_and_clean_sigterm(procs: Processes) -> None:
    port = free_port()
    broker = start_broker(procs, *FAST, f"broker.metrics_port={port}")
    worker = Worker(broker.endpoint, "w1")
    try:
        worker.lease(1)

        def scrape() -> str:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                return ""

        text = wait_for(lambda: 'loraflow_broker_leases_total{event="granted"} 1' in scrape() and scrape(), 10,
                        "the lease to show in /metrics", procs)
        assert "loraflow_broker_workers 1" in text
    finally:
        worker.close()
    broker.proc.signal(signal.SIGINT)
    assert broker.proc.wait(10) == 0
    assert (broker.run_dir / "broker" / "state.json").is_file()


@pytest.mark.parametrize("model_vocab", [64])
def test_token_ids_checked_against_the_model_vocab(procs: Processes, tmp_path, model_vocab: int) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(f'{{"vocab_size": {model_vocab}}}')
    broker = start_broker(procs, *FAST, f'model.path="{model_dir}"')
    worker = Worker(broker.endpoint, "w1")
    try:
        assert worker.welcome.vocab_size == model_vocab
        lease, = worker.lease(1).leases
        worker.submit(lease, vocab=200)
        error = worker.reply()
        assert error.code == "invalid_group" and "outside [0, 64)" in error.message
        worker.submit(worker.lease(1).leases[0], vocab=64)
        assert worker.reply().status == "accepted"
    finally:
        worker.close()


def test_grant_to_a_vanished_worker_goes_back_to_the_queue(procs: Processes) -> None:
    """ROUTER_MANDATORY: a reply to a peer whose connection is gone fails at once; its leases are re-queued."""
    broker = start_broker(procs, *FAST, "run.max_staleness=3", "broker.capacity_groups=2",
                          "broker.heartbeat_misses=50")  # death by silence would take 10 s: not what is tested
    ctx = zmq.Context()
    ghost = sockets.dealer_socket(ctx, broker.endpoint, identity=b"worker/ghost")
    worker, learner = Worker(broker.endpoint, "w1"), Learner(broker.endpoint, token=broker.run_token)
    try:
        ghost.send_multipart(codec.encode(Hello(role="worker", client_id="ghost", session="g")))
        assert ghost.poll(5000)
        ghost.recv_multipart()
        for lease in worker.lease(2).leases:  # the whole capacity
            worker.submit(lease)
            assert worker.reply().status == "accepted"
        ghost.send_multipart(codec.encode(LeaseRequest(max_leases=2, wait_ms=30_000)))
        wait_for(lambda: broker.stats()["waiting"]["lease_requests"] == 1, 5, "the ghost's request to park", procs)
        ghost.close(linger=0)  # the process is gone without a Bye
        wait_for(lambda: broker.stats()["connections"].get("disconnected", 0) >= 1, 5, "the disconnect", procs)
        learner.ack(learner.batch(2).record)  # frees the capacity: the parked grant is sent to nobody
        stats = wait_for(lambda: (s := broker.stats())["send_failed"] and s, 5, "the failed send", procs)
        # EHOSTUNREACH once zmq has dropped the pipe, EAGAIN while it is still being torn down: refused either way
        assert sum(stats["send_failed"].values()) == 1 and set(stats["send_failed"]) <= {"unreachable", "hwm"}
        assert stats["lease_events"]["undeliverable"] == 2 and stats["prompts"]["queued"] == 2
        assert [lease.group_id for lease in worker.lease(2).leases] == ["0:2", "0:3"]
    finally:
        worker.close()
        learner.close()
        ctx.destroy(linger=0)
