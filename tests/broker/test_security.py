"""The broker under CURVE: authorised keys work in their role only; unknown keys never reach it."""

from __future__ import annotations

import uuid
from pathlib import Path

import zmq

from loraflow.common import codec, protocol, sockets
from loraflow.common.protocol import Error, Hello
from loraflow.common.security import ClientSecurity, generate_keys
from loraflow.common.transport import fetch_stats
from tests.broker.clients import Worker, make_group
from tests.support import Processes, start_broker


def test_keys_bind_roles(procs: Processes, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, {"w1": "worker", "trainer": "learner", "obs": "observer"})
    broker = start_broker(procs, "run.group_size=2", "security.enabled=true", f'security.keys_dir="{keys}"')
    worker_key = ClientSecurity.load(keys, "w1")
    worker = Worker(broker.endpoint, "w1", security=worker_key)
    ctx = zmq.Context()
    try:
        lease, = worker.lease(1).leases
        worker.submit(lease)
        assert worker.reply().status == "accepted"
        # the worker's key cannot register as a learner, even under a learner identity
        impostor = sockets.dealer_socket(ctx, broker.endpoint, identity=b"learner/evil", security=worker_key)
        impostor.send_multipart(codec.encode(Hello(role="learner", client_id="evil", session=uuid.uuid4().hex)))
        assert impostor.poll(5000)
        error = codec.decode(impostor.recv_multipart())[0]
        assert isinstance(error, Error) and error.code == "forbidden" and "authorised as a worker" in error.message
        impostor.close(0)
        # without any key, nothing gets through (the handshake fails, no reply)
        plain = sockets.dealer_socket(ctx, broker.endpoint, identity=b"observer/plain")
        plain.send_multipart(codec.encode(protocol.StatsRequest()))
        assert not plain.poll(500)
        plain.close(0)
        snapshot = fetch_stats(broker.endpoint, security=ClientSecurity.load(keys, "obs"))
        assert snapshot["rejected"] == {"forbidden": 1} and snapshot["group_events"] == {"accepted": 1}
        assert snapshot["workers"][0]["id"] == "w1"
    finally:
        worker.close()
        ctx.destroy(linger=0)


def test_a_client_id_and_its_leases_belong_to_the_key_that_registered_them(procs: Processes, tmp_path: Path) -> None:
    """Two authorised worker keys: the second can neither evict the first by saying Hello with its client id
    (which would reclaim its leases) nor submit for its leases."""
    keys = tmp_path / "keys"
    generate_keys(keys, {"w1": "worker", "w2": "worker", "obs": "observer"})
    broker = start_broker(procs, "run.group_size=2", "security.enabled=true", f'security.keys_dir="{keys}"')
    worker = Worker(broker.endpoint, "w1", security=ClientSecurity.load(keys, "w1"))
    ctx = zmq.Context()
    try:
        lease, = worker.lease(1).leases
        rival = sockets.dealer_socket(ctx, broker.endpoint, identity=b"worker/w1/rival",
                                      security=ClientSecurity.load(keys, "w2"))
        rival.send_multipart(codec.encode(Hello(role="worker", client_id="w1", session=uuid.uuid4().hex)))
        assert rival.poll(5000)
        error = codec.decode(rival.recv_multipart())[0]
        assert isinstance(error, Error) and error.code == "forbidden" and "registered by another key" in error.message
        rival.send_multipart(codec.encode(Hello(role="worker", client_id="w2", session=uuid.uuid4().hex)))
        assert rival.poll(5000) and codec.decode(rival.recv_multipart())[0].KIND == protocol.Kind.WELCOME
        record, tensors = make_group(lease, "w2")
        rival.send_multipart(codec.encode(record, tensors))
        assert rival.poll(5000)
        error = codec.decode(rival.recv_multipart())[0]
        assert isinstance(error, Error) and error.code == "unknown_lease", error
        snapshot = fetch_stats(broker.endpoint, security=ClientSecurity.load(keys, "obs"))
        assert snapshot["leases"]["outstanding"] == 1 and snapshot["peers_gone"] == {}
        assert sorted(w["id"] for w in snapshot["workers"]) == ["w1", "w2"]
        worker.submit(lease)
        assert worker.reply().status == "accepted"  # w1 kept its registration and its lease
        rival.close(0)
    finally:
        worker.close()
        ctx.destroy(linger=0)
