"""The worker's broker session against a scripted ROUTER: keep-until-ack, re-send after a broker restart,
adapter notices and fetches, verification of received adapters, lease grants."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from loraflow.common import codec, protocol
from loraflow.common.config import load_config
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import Error, GroupAck, Kind, LeaseGrant, Welcome
from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.client import BrokerSession
from loraflow.rollout_worker.samples import FinishedGroup
from tests.support import wait_for
from tests.worker.helpers import Adapter, lease


class ScriptedBroker:
    """A ROUTER that answers as the test says and records what arrives."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.identity = b""

    def recv(self, kind: Kind, timeout_s: float = 5.0) -> tuple[object, list]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                self.identity, *frames = self.sock.recv_multipart()
                record, envelope = codec.decode(frames)
                if record.KIND == kind:
                    return record, envelope.frames
        raise AssertionError(f"no {kind.name} arrived within {timeout_s} s")

    def send(self, message: object, frames: list | None = None) -> None:
        payload = codec.encode(message) if frames is None else frames
        self.sock.send_multipart([self.identity, *payload])

    def welcome(self, broker_id: str, latest_version: int = 0) -> None:
        self.send(Welcome(broker_id=broker_id, latest_version=latest_version, group_size=2, groups_per_step=1,
                          max_staleness=1, heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, lease_timeout_s=5,
                          max_message_bytes=1 << 24))


@pytest.fixture
def broker() -> Iterator[ScriptedBroker]:
    b = ScriptedBroker()
    yield b
    b.sock.close(0)


@pytest.fixture
def session(broker: ScriptedBroker, tmp_path: Path) -> Iterator[BrokerSession]:
    config = load_config(overrides=[f'broker.endpoint="{broker.endpoint}"', "broker.heartbeat_interval_s=0.05"])
    s = BrokerSession(config, worker_id="w1", store=AdapterStore(tmp_path / "adapters"), metrics=Metrics(),
                      wake=threading.Event())
    starter = threading.Thread(target=s.start, args=(10,))
    starter.start()
    hello, _ = broker.recv(Kind.HELLO)
    assert hello.client_id == "w1" and hello.backend == "hf"
    broker.welcome("b1")
    starter.join(10)
    yield s
    s.close()


def finished_group(group_id: str) -> FinishedGroup:
    record = protocol.RolloutGroup(group_id=group_id, lease_id="l-" + group_id, worker_id="w1", prompt_lens=[2],
                                   completion_lens=[3], rewards=[1.0], finish_reasons=["stop"], min_version=0,
                                   max_version=0)
    tensors = [("prompt_ids", np.array([1, 2], np.int32)), ("completion_ids", np.array([3, 4, 5], np.int32)),
               ("logprobs", np.full(3, -0.5, np.float32)), ("versions", np.zeros(3, np.int32)),
               ("loss_mask", np.ones(3, np.uint8))]
    return FinishedGroup(group=record, tensors=tensors)


def test_groups_are_kept_until_acked_and_resent_after_a_broker_restart(broker: ScriptedBroker,
                                                                        session: BrokerSession) -> None:
    for group_id in ("0:1", "0:2", "0:3"):
        session.submit(finished_group(group_id))
    for _ in range(3):
        broker.recv(Kind.ROLLOUT_GROUP)
    broker.send(GroupAck(ref_id="0:1", status="accepted"))
    broker.send(Error(code="invalid_group", message="bad", ref_kind=Kind.ROLLOUT_GROUP, ref_id="0:3"))
    wait_for(lambda: session.num_unacked == 1, 5, "the ack and the rejection to be processed")
    assert session.metrics.counter("groups_rejected", reason="invalid_group") == 1
    broker.welcome("b2")  # a restarted broker: the session re-sends what was not acknowledged
    resent, frames = broker.recv(Kind.ROLLOUT_GROUP)
    assert resent.group_id == "0:2" and np.frombuffer(frames[1], np.int32).tolist() == [3, 4, 5]
    broker.send(GroupAck(ref_id="0:2", status="duplicate"))
    wait_for(lambda: session.num_unacked == 0, 5, "the duplicate ack")
    assert session.metrics.counter("groups_acked", status="duplicate") == 1
    assert session.metrics.counter("groups_resent") == 1


def test_adapter_notice_fetch_and_verified_update(broker: ScriptedBroker, session: BrokerSession,
                                                  adapters: list[Adapter]) -> None:
    adapter = adapters[1]
    broker.send(protocol.AdapterNotice(version=2, num_bytes=1, sha256=adapter.update.sha256))
    fetch, _ = broker.recv(Kind.ADAPTER_FETCH)
    assert fetch.version == 0  # the newest
    corrupt = [bytes(f) for f in adapter.frames]
    corrupt[-1] = bytes(len(corrupt[-1]))
    broker.send(None, corrupt)
    wait_for(lambda: session.metrics.counter("adapters_rejected", reason="sha256") == 1, 5, "the rejection")
    assert session.take_adapter() is None
    broker.send(None, [bytes(f) for f in adapter.frames])
    received = wait_for(session.take_adapter, 5, "the verified adapter in the slot")
    assert received.version == 2 and (received.path / "adapter_model.safetensors").is_file()
    broker.send(None, [bytes(f) for f in adapters[0].frames])  # an older version arriving late is ignored
    broker.send(protocol.AdapterNotice(version=2, num_bytes=1, sha256=""))  # a version already held: no fetch
    grant = LeaseGrant(leases=[lease("0:7")], reason="", latest_version=2)
    broker.send(grant)
    assert session.grants.get(timeout=5).leases[0].group_id == "0:7"
    assert session.take_adapter() is None and session.metrics.counter("adapters_superseded") == 1
    assert session.metrics.counter("adapter_fetches") == 1


def test_a_backlog_of_notices_costs_one_fetch_and_only_the_newest_is_written(
        broker: ScriptedBroker, session: BrokerSession, adapters: list[Adapter]) -> None:
    """At most one adapter ahead of the backend: one fetch in flight or one adapter in the slot, never both."""
    for version in (1, 2, 3):  # published faster than one round trip
        broker.send(protocol.AdapterNotice(version=version, num_bytes=1, sha256=""))
    broker.recv(Kind.ADAPTER_FETCH)
    broker.send(None, [bytes(f) for f in adapters[2].frames])  # the broker's newest: v3
    wait_for(lambda: session.metrics.counter("adapters_received") == 1, 5, "v3 to be verified")
    broker.send(protocol.AdapterNotice(version=4, num_bytes=1, sha256=""))  # the slot is full: no fetch yet
    broker.send(LeaseGrant(leases=[lease("0:1")], latest_version=4))
    session.grants.get(timeout=5)
    assert session.metrics.counter("adapter_fetches") == 1
    assert [p.name for p in session.store.directory.iterdir()] == ["v000003"]
    assert session.take_adapter().version == 3  # taking it asks for the next one while v3 loads
    broker.recv(Kind.ADAPTER_FETCH)
    assert session.metrics.counter("adapter_fetches") == 2


def test_lease_requests_and_stale_adapter_grants(broker: ScriptedBroker, session: BrokerSession) -> None:
    session.request_leases(3, adapter_version=0, wait_ms=500)
    assert session.lease_request_pending
    request, _ = broker.recv(Kind.LEASE_REQUEST)
    assert (request.max_leases, request.wait_ms) == (3, 500)
    broker.send(LeaseGrant(reason="stale_adapter", latest_version=4))
    assert session.grants.get(timeout=5).reason == "stale_adapter"
    fetch, _ = broker.recv(Kind.ADAPTER_FETCH)  # the worker must catch up before it may generate
    assert fetch.version == 0 and not session.lease_request_pending
    session.return_leases(["l1", "l2"], "worker stopping")
    returned, _ = broker.recv(Kind.LEASE_RETURN)
    assert returned.lease_ids == ["l1", "l2"]


def test_close_after_a_signal_interrupted_the_dispatcher_start(broker: ScriptedBroker, tmp_path: Path) -> None:
    """A SIGTERM during start-up can land inside Thread.start() (CI saw it): the thread object exists but was
    never started, and close() must still stop the link instead of raising."""
    config = load_config(overrides=[f'broker.endpoint="{broker.endpoint}"', "broker.heartbeat_interval_s=0.05"])
    s = BrokerSession(config, worker_id="w1", store=AdapterStore(tmp_path / "adapters"), metrics=Metrics(),
                      wake=threading.Event())
    s._thread = threading.Thread(target=s._dispatch, args=({},))  # what start() had built when the signal came
    s.close(reason="stopping")
    assert not s._thread.is_alive()
