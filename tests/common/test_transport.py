"""BrokerLink against a scripted ROUTER: hello, heartbeats, held-back kinds, re-hello, broker restart."""

from __future__ import annotations

import time

import pytest
import zmq

from loraflow.common import codec, protocol
from loraflow.common.protocol import Hello, Kind, Welcome
from loraflow.common.transport import BrokerLink, BrokerUnavailable, Incoming, Reconnected, fetch_stats


def welcome(broker_id: str = "b1", latest_version: int = 0) -> Welcome:
    return Welcome(broker_id=broker_id, latest_version=latest_version, group_size=2, groups_per_step=1,
                   max_staleness=1, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5, lease_timeout_s=5,
                   max_message_bytes=1 << 20)


class ScriptedBroker:
    """A ROUTER that records what arrives and answers as told."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def recv(self, timeout_s: float = 5.0, kind: Kind | None = None):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                identity, *frames = self.sock.recv_multipart()
                record, _ = codec.decode(frames)
                if kind is None or record.KIND == kind:
                    return identity, record
        raise AssertionError(f"nothing of kind {kind} arrived")

    def send(self, identity: bytes, message) -> None:
        self.sock.send_multipart([identity, *codec.encode(message)])

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def broker():
    b = ScriptedBroker()
    yield b
    b.close()


def test_hello_welcome_heartbeats_and_messages(broker: ScriptedBroker) -> None:
    link = BrokerLink(broker.endpoint, Hello(role="worker", client_id="w1"), heartbeat_interval_s=0.05)
    link._thread.start()
    identity, hello = broker.recv(kind=Kind.HELLO)
    assert identity == b"worker/w1" and hello.session and hello.pid
    broker.send(identity, welcome(latest_version=3))
    assert link._welcomed.wait(5) and link.latest_version == 3
    link.set_state("generating", adapter_version=2, tokens=7)
    _, beat = broker.recv(kind=Kind.HEARTBEAT)
    for _ in range(5):  # the state set above shows up in the next beats
        if beat.state == "generating":
            break
        _, beat = broker.recv(kind=Kind.HEARTBEAT)
    assert beat.state == "generating" and beat.adapter_version == 2 and beat.counters == {"tokens": 7}
    broker.send(identity, protocol.Heartbeat(latest_version=5))
    link.send(protocol.LeaseRequest(max_leases=1))
    assert broker.recv(kind=Kind.LEASE_REQUEST)[1].max_leases == 1
    broker.send(identity, protocol.AdapterNotice(version=5, num_bytes=1, sha256=""))
    broker.send(identity, protocol.LeaseGrant(reason="backpressure"))
    grant = link.recv(5, kinds=[Kind.LEASE_GRANT])
    assert isinstance(grant, Incoming) and grant.kind == Kind.LEASE_GRANT
    notice = link.recv(1)  # held back while waiting for the grant, delivered next
    assert isinstance(notice, Incoming) and notice.record.version == 5
    assert link.latest_version == 5
    assert link.recv(0.05) is None
    link.close("done")
    assert broker.recv(kind=Kind.BYE)[1].reason == "done"


def test_not_registered_triggers_hello_and_new_broker_id_reports_reconnect(broker: ScriptedBroker) -> None:
    link = BrokerLink(broker.endpoint, Hello(role="learner", client_id="learner"), heartbeat_interval_s=0.05)
    link._thread.start()
    identity, _ = broker.recv(kind=Kind.HELLO)
    broker.send(identity, welcome("b1"))
    assert link._welcomed.wait(5)
    broker.send(identity, protocol.Error(code="not_registered", message="who?"))
    identity, _ = broker.recv(kind=Kind.HELLO)
    broker.send(identity, welcome("b2"))
    item = link.recv(5)
    assert isinstance(item, Reconnected) and item.welcome.broker_id == "b2"
    assert link.num_reconnects == 1
    link.close(send_bye=False)


def test_silent_broker_gets_hello_again(broker: ScriptedBroker) -> None:
    link = BrokerLink(broker.endpoint, Hello(role="worker", client_id="w2"), heartbeat_interval_s=0.05,
                      heartbeat_timeout_s=0.3)
    link._thread.start()
    identity, _ = broker.recv(kind=Kind.HELLO)
    broker.send(identity, welcome())
    assert link._welcomed.wait(5)
    broker.recv(kind=Kind.HELLO, timeout_s=3)  # nothing answered for > timeout: it says hello again
    link.close(send_bye=False)


def test_bad_message_from_broker_is_counted_not_fatal(broker: ScriptedBroker) -> None:
    link = BrokerLink(broker.endpoint, Hello(role="worker", client_id="w3"), heartbeat_interval_s=0.05)
    link._thread.start()
    identity, _ = broker.recv(kind=Kind.HELLO)
    broker.sock.send_multipart([identity, b"garbage"])
    broker.send(identity, welcome())
    assert link._welcomed.wait(5)
    assert link.num_decode_errors == 1
    link.close()


def test_start_times_out_with_a_clear_message() -> None:
    link = BrokerLink("tcp://127.0.0.1:1", Hello(role="worker", client_id="w4"))
    with pytest.raises(BrokerUnavailable, match="no Welcome from the broker at tcp://127.0.0.1:1"):
        link.start(timeout_s=0.3)


def test_fetch_stats(broker: ScriptedBroker) -> None:
    import threading

    def answer() -> None:
        identity, _ = broker.recv(kind=Kind.STATS_REQUEST)
        broker.send(identity, protocol.Stats(snapshot={"ok": 1}))

    thread = threading.Thread(target=answer)
    thread.start()
    assert fetch_stats(broker.endpoint, timeout_s=5) == {"ok": 1}
    thread.join()
    with pytest.raises(BrokerUnavailable, match="no stats"):
        fetch_stats(broker.endpoint, timeout_s=0.2)


def test_the_same_broker_welcoming_us_back_reports_a_reconnect(broker: ScriptedBroker) -> None:
    """A cut link: the broker, still running, declared us dead (not_registered), so what we sent meanwhile may be
    lost; its Welcome to the new hello must make the caller re-send, though the broker id is unchanged."""
    link = BrokerLink(broker.endpoint, Hello(role="worker", client_id="w9"), heartbeat_interval_s=0.05)
    link._thread.start()
    identity, _ = broker.recv(kind=Kind.HELLO)
    broker.send(identity, welcome("b1"))
    assert link._welcomed.wait(5)
    broker.send(identity, welcome("b1"))  # a duplicate Welcome to a hello we did not send again: nothing
    broker.send(identity, protocol.Error(code="not_registered", message="declared dead"))
    identity, _ = broker.recv(kind=Kind.HELLO)
    broker.send(identity, welcome("b1"))
    item = link.recv(5)
    assert isinstance(item, Reconnected) and item.welcome.broker_id == "b1"
    assert link.num_reconnects == 1 and link.recv(0.2) is None
    link.close(send_bye=False)
