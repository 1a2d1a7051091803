"""The broker under CURVE: authorised keys work in their role only; unknown keys never reach it."""

from __future__ import annotations

import uuid
from pathlib import Path

import zmq

from common import protocol, sockets
from common.protocol import Error, Hello
from common.security import ClientSecurity, generate_keys
from common.transport import fetch_stats
from tests.broker.clients import Worker
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
        impostor.send_multipart(protocol.encode(Hello(role="learner", client_id="evil", session=uuid.uuid4().hex)))
        assert impostor.poll(5000)
        error = protocol.decode(impostor.recv_multipart())[0]
        assert isinstance(error, Error) and error.code == "forbidden" and "authorised as a worker" in error.message
        impostor.close(0)
        # without any key, nothing gets through (the handshake fails, no reply)
        plain = sockets.dealer_socket(ctx, broker.endpoint, identity=b"observer/plain")
        plain.send_multipart(protocol.encode(protocol.StatsRequest()))
        assert not plain.poll(500)
        plain.close(0)
        snapshot = fetch_stats(broker.endpoint, security=ClientSecurity.load(keys, "obs"))
        assert snapshot["rejected"] == {"forbidden": 1} and snapshot["group_events"] == {"accepted": 1}
        assert snapshot["workers"][0]["id"] == "w1"
    finally:
        worker.close()
        ctx.destroy(linger=0)
