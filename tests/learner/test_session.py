"""BrokerSession against scripted brokers: long-polled batches, adapter acks, and re-sending after a restart."""

from __future__ import annotations

import time

import pytest
import torch

from loraflow.common.config import load_config
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import BatchAck
from loraflow.learner.publish import AdapterSnapshot, tensors_sha256
from loraflow.learner.session import BatchRequestRefused, BrokerSession
from tests.learner.scripted import ScriptedBroker


def snapshot(version: int) -> AdapterSnapshot:
    tensors = [("base_model.model.layer.lora_A.weight", torch.full((4, 8), float(version))),
               ("base_model.model.layer.lora_B.weight", torch.zeros(8, 4))]
    return AdapterSnapshot(version=version, step=version, tensors=tensors, adapter_config={"r": 4},
                           sha256=tensors_sha256(tensors), base_model="tiny")


def poll_until(session: BrokerSession, condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    batch = None
    while time.monotonic() < deadline:
        batch = session.poll(0.05) or batch
        if condition(batch):
            return batch
    raise AssertionError("condition not reached")


SCRIPTED_TOKEN = 'security.run_token="scripted"'  # the scripted broker writes no run token file (common/run_token.py)


def test_batches_acks_and_resending_after_a_broker_restart() -> None:
    first = ScriptedBroker(allowed_batches=1, answer_batch_acks=False)
    config = load_config(None, [f"broker.endpoint=\"{first.endpoint}\"", "broker.heartbeat_interval_s=0.1",
                                "broker.heartbeat_misses=2", SCRIPTED_TOKEN])
    metrics = Metrics()
    session = BrokerSession(config, version=0, metrics=metrics)
    second = None
    try:
        assert session.start(5).broker_id == "scripted"
        session.want_batch(2, 100, 0)
        batch = poll_until(session, lambda b: b is not None)
        assert batch.record.batch_id == "batch-0" and len(batch.record.groups) == 2
        session.publish(snapshot(1))
        poll_until(session, lambda _: session.adapter_acks)
        assert [a.version for a in session.adapter_acks] == [1] and session.adapter_acks[0].seconds > 0
        session.ack_batch(BatchAck(batch_id="batch-0", step=1, trained_version=0, group_ids=["0:0", "0:1"]))
        session.want_batch(2, 100, 1)
        assert session.poll(0.5) is None  # the first broker has no second batch: empty long-polls, re-asked
        assert session.num_unacked == 1  # it never acknowledged the BatchAck
        assert len(first.served) == 1

        first.close()  # the broker dies; a new one comes up on the same port
        second = ScriptedBroker(port=first.port, broker_id="second", allowed_batches=5)
        batch = poll_until(session, lambda b: b is not None)
        assert session.welcome.broker_id == "second" and metrics.counter("broker_reconnects") == 1
        # the new broker got the unacknowledged BatchAck, the newest adapter, and the outstanding request
        assert [a.batch_id for a in second.acks] == ["batch-0"] and second.acks[0].group_ids == ["0:0", "0:1"]
        assert [p.version for p in second.published] == [1]
        assert second.hellos[-1].adapter_version == 1
        assert batch.record.batch_id == "batch-1"
        assert session.drain(5) and session.num_unacked == 0
    finally:
        session.close()
        first.close()
        if second is not None:
            second.close()


def test_an_adapter_ack_is_timed_at_its_arrival_not_when_the_loop_reads_it() -> None:
    """The learner reads its inbox between steps; an Ack read a whole step after it arrived still counts the
    broker's round trip alone (``adapter_ack_s`` in the step lines)."""
    broker = ScriptedBroker()
    config = load_config(None, [f"broker.endpoint=\"{broker.endpoint}\"", SCRIPTED_TOKEN])
    session = BrokerSession(config, version=0, metrics=Metrics())
    try:
        session.start(5)
        session.publish(snapshot(1))
        time.sleep(1.0)  # "a training step": nobody reads the inbox, the Ack arrives meanwhile
        poll_until(session, lambda _: session.adapter_acks)
        assert [a.version for a in session.adapter_acks] == [1]
        assert 0 < session.adapter_acks[0].seconds < 0.5
    finally:
        session.close()
        broker.close()


def test_refused_batch_requests_are_retried_at_the_poll_pace_or_fatal_for_limit() -> None:
    broker = ScriptedBroker(refuse_requests="internal")
    config = load_config(None, [f"broker.endpoint=\"{broker.endpoint}\"", SCRIPTED_TOKEN])
    session = BrokerSession(config, version=0, metrics=Metrics())
    try:
        session.start(5)
        session.want_batch(2, 100, 0)
        for _ in range(5):
            assert session.poll(0.1) is None
        assert 3 <= broker.num_requests <= 6  # asked again once per poll, not in a tight loop
        assert session.metrics.counter("broker_errors", code="internal") >= 3
        broker.refuse_requests = "limit"
        with pytest.raises(BatchRequestRefused, match="capacity_groups"):
            for _ in range(20):
                session.poll(0.1)
    finally:
        session.close()
        broker.close()


def test_a_refused_adapter_version_is_no_longer_awaited() -> None:
    """The broker refuses a version it already has (stale_version): the Error names it as an int (ref_version),
    and the session stops waiting for that version's Ack instead of counting it unacknowledged for ever."""
    broker = ScriptedBroker()
    broker.latest_version = 5  # it knows a newer version than the one published below
    config = load_config(None, [f"broker.endpoint=\"{broker.endpoint}\"", SCRIPTED_TOKEN])
    session = BrokerSession(config, version=0, metrics=Metrics())
    try:
        session.start(5)
        session.publish(snapshot(3))
        assert session.num_unacked == 1
        poll_until(session, lambda _: session.num_unacked == 0)
        assert session.adapter_acks == []
    finally:
        session.close()
        broker.close()
