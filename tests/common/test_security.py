"""CURVE: authorised keys get their role as User-Id, unknown keys are refused and counted, keys added live."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from loraflow.common import codec, protocol, sockets
from loraflow.common.security import ClientSecurity, SecurityError, ServerSecurity, generate_keys, role_of
from loraflow.common.transport import watched_dealer
from tests.support import wait_for


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "keys", {"w1": "worker", "learner": "learner"})
    return tmp_path / "keys"


def serve(keys: Path):
    ctx = zmq.Context()
    server = ServerSecurity.load(keys)
    server.start(ctx)
    router, endpoint = sockets.router_socket(ctx, "tcp://127.0.0.1:0", max_message_bytes=1 << 20, security=server)
    return ctx, server, router, endpoint


def test_authorised_clients_carry_their_role_and_strangers_are_refused(keys: Path, tmp_path: Path) -> None:
    ctx, server, router, endpoint = serve(keys)
    try:
        worker = sockets.dealer_socket(ctx, endpoint, identity=b"worker/w1", security=ClientSecurity.load(keys, "w1"))
        worker.send_multipart(codec.encode(protocol.Bye()))
        assert router.poll(5000)
        identity, *frames = router.recv_multipart(copy=False)
        assert identity.bytes == b"worker/w1" and role_of(frames[0]) == "worker"

        generate_keys(tmp_path / "other", {"mallory": "learner"})  # a valid pair the broker never authorised
        mallory = ClientSecurity.load(tmp_path / "other", "mallory")
        mallory.broker_public = server.public  # knows the broker's public key, but is not authorised
        stranger = sockets.dealer_socket(ctx, endpoint, identity=b"learner/x", security=mallory)
        stranger.send_multipart(codec.encode(protocol.Bye()))
        wait_for(lambda: server.num_refused >= 1, 5, "the stranger to be refused")
        assert not router.poll(300)

        generate_keys(keys, {"w2": "worker"})  # admitted without restarting the broker
        late = sockets.dealer_socket(ctx, endpoint, identity=b"worker/w2", security=ClientSecurity.load(keys, "w2"))
        late.send_multipart(codec.encode(protocol.Bye()))
        assert router.poll(5000)
        _, *frames = router.recv_multipart(copy=False)
        assert role_of(frames[0]) == "worker"
        for sock in (worker, stranger, late):
            sock.close(0)
    finally:
        router.close(0)
        server.stop()
        ctx.destroy(linger=0)


def test_a_handshake_failure_is_diagnosed_however_late_the_client_looks(keys: Path) -> None:
    """zmq does not retry a mechanism mismatch: a monitor attached after the connect (a busy machine between
    the two calls) saw nothing and the client waited out its connect timeout. The watch is attached first, so
    the failure is there to read a second later."""
    ctx, server, router, endpoint = serve(keys)
    try:
        plain, watch = watched_dealer(ctx, endpoint, identity=b"worker/plain", security=None, role="worker")
        time.sleep(1.0)  # the handshake has failed long before the client reads its monitor
        deadline, problem = time.monotonic() + 10, None
        while problem is None and time.monotonic() < deadline:
            problem = watch.read() if watch.monitor.poll(200) else None
        assert problem is not None and "requires CURVE" in problem, problem
        watch.close()
        plain.close(0)
    finally:
        router.close(0)
        server.stop()
        ctx.destroy(linger=0)


def test_plain_frames_have_no_role() -> None:
    assert role_of(zmq.Frame(b"x")) is None


def test_key_errors_say_what_to_do(tmp_path: Path, keys: Path) -> None:
    with pytest.raises(SecurityError, match="loraflow keys"):
        ClientSecurity.load(tmp_path / "nothing", "w1")
    assert generate_keys(keys, {"w1": "worker"}).kept == [("broker", "broker"), ("w1", "worker")]  # kept as is
    with pytest.raises(SecurityError, match="is authorised as a worker"):
        generate_keys(keys, {"w1": "learner"})
    with pytest.raises(SecurityError, match="must be one of"):
        generate_keys(keys, {"x": "admin"})
    empty = tmp_path / "empty"
    generate_keys(empty, {})
    with pytest.raises(SecurityError, match="holds no client keys"):
        ServerSecurity.load(empty)
    assert oct((keys / "w1.key_secret").stat().st_mode & 0o777) == "0o600"


def test_keys_command_makes_a_usable_layout(tmp_path: Path) -> None:
    from loraflow.deploy.cli import main

    assert main(["keys", str(tmp_path / "k")]) == 0
    for role in ("worker", "learner", "observer"):
        assert (tmp_path / "k" / "authorized" / role / f"{role}.key").is_file()
    assert main(["keys", str(tmp_path / "k"), "--worker", "gpu-3"]) == 0
    assert ServerSecurity.load(tmp_path / "k").lookup(
        ClientSecurity.load(tmp_path / "k", "gpu-3").public) == ("worker", "gpu-3")
    assert main(["keys", str(tmp_path / "k"), "--worker", "gpu-3"]) == 0  # again: kept
    assert main(["keys", str(tmp_path / "k"), "--learner", "gpu-3"]) == 2  # another role: refused
