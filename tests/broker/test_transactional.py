"""Handlers validate first, then apply: a bug in a validation costs one message (Error internal, nothing
changed, the loop serves on); a bug in an apply half raises HalfApplied, which the server's loop lets end the
process before the half-applied state is written."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq

from loraflow.broker import core as core_module
from loraflow.broker import groups as groups_module
from loraflow.broker.core import BrokerCore
from loraflow.broker.dispatch import HalfApplied
from loraflow.broker.server import BrokerServer
from loraflow.broker.state import load_state
from loraflow.common import codec, sockets
from loraflow.common.config import load_config
from loraflow.common.protocol import Error, Hello, Kind, LeaseGrant, LeaseRequest, StatsRequest
from loraflow.common.tasks import load_task
from tests.broker.clients import make_group
from tests.broker.harness import W1, Harness


def _boom(*_args, **_kwargs):
    raise RuntimeError("injected bug")


def test_a_bug_in_validation_changes_nothing_and_one_in_apply_is_half_applied(monkeypatch) -> None:
    h = Harness()
    h.hello(W1)
    lease, other = h.lease(W1, 2)
    monkeypatch.setattr(groups_module, "judge", _boom)
    record, tensors = make_group(lease, "w1")
    changes = h.core.ledger.num_changes
    with pytest.raises(RuntimeError, match="injected") as caught:
        h.core.handle(W1, codec.encode(record, tensors), h.now)
    assert not isinstance(caught.value, HalfApplied)
    assert h.core.ledger.num_changes == changes and h.core.ledger.state((0, 0)) == "leased"
    monkeypatch.undo()
    monkeypatch.setattr(h.core.ledger, "accept", _boom)
    with pytest.raises(HalfApplied, match="rollout_group from worker/w1"):
        h.core.handle(W1, codec.encode(record, tensors), h.now)
    assert not h.core._applying  # the flag does not outlive the handler


def _serve(server: BrokerServer, failures: list) -> None:
    try:
        server.serve()
    except BaseException as exc:  # noqa: BLE001 - what ended the loop is the test's subject
        failures.append(exc)


def _reply(sock: zmq.Socket, kind: int, timeout_s: float = 20.0) -> object:
    while sock.poll(int(timeout_s * 1000)):
        record, _ = codec.decode(sock.recv_multipart())
        if record.KIND == kind:
            return record
    raise AssertionError(f"no {Kind(kind).name} within {timeout_s} s")


def test_the_loop_answers_internal_for_a_validation_bug_and_ends_on_an_apply_bug(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    config = load_config(None, ["broker.bind=tcp://127.0.0.1:0", "run.group_size=2", f"run.run_dir={tmp_path}"])
    state_path = tmp_path / "state.json"
    core = BrokerCore(config, task=load_task(config.run.task, config.run.seed), vocab_size=200,
                      state_path=state_path)
    ctx = zmq.Context()
    server = BrokerServer(config, core, ctx=ctx)
    failures: list[BaseException] = []
    thread = threading.Thread(target=_serve, args=(server, failures), daemon=True)
    thread.start()
    sock = sockets.dealer_socket(ctx, server.endpoint, identity=W1)
    try:
        sock.send_multipart(codec.encode(Hello(role="worker", client_id="w1", session="s1")))
        _reply(sock, Kind.WELCOME)
        sock.send_multipart(codec.encode(LeaseRequest(max_leases=1, adapter_version=0)))
        grant = _reply(sock, Kind.LEASE_GRANT)
        assert isinstance(grant, LeaseGrant) and len(grant.leases) == 1
        record, tensors = make_group(grant.leases[0], "w1")

        monkeypatch.setattr(groups_module, "judge", _boom)
        sock.send_multipart(codec.encode(record, tensors))
        error = _reply(sock, Kind.ERROR)
        assert isinstance(error, Error) and error.code == "internal"
        sock.send_multipart(codec.encode(StatsRequest()))
        stats = _reply(sock, Kind.STATS).snapshot
        assert stats["prompts"]["leased"] == 1  # served on, nothing changed
        monkeypatch.undo()

        # a bug before the message is counted (the broker's own codec module; the test's decode stays real)
        monkeypatch.setattr(core_module, "codec", SimpleNamespace(**{**vars(codec), "decode_envelope": _boom}))
        sock.send_multipart(codec.encode(LeaseRequest(max_leases=1, adapter_version=0)))
        assert _reply(sock, Kind.ERROR).code == "internal"
        monkeypatch.undo()
        sock.send_multipart(codec.encode(StatsRequest()))
        after = _reply(sock, Kind.STATS).snapshot
        assert after["messages_in"]["lease_request"] == stats["messages_in"]["lease_request"] + 1  # still counted
        assert after["rejected"]["internal"] == stats["rejected"]["internal"] + 1

        monkeypatch.setattr(core.ledger, "accept", _boom)
        sock.send_multipart(codec.encode(record, tensors))
        thread.join(timeout=30)
        assert not thread.is_alive(), "the loop carried on after a bug in an apply half"
        assert len(failures) == 1 and isinstance(failures[0], HalfApplied)
        assert load_state(state_path) is not None  # what is on disk is a whole state of before the message
        restarted = BrokerCore(config, task=load_task(config.run.task, config.run.seed), state_path=state_path)
        assert restarted.ledger.state((0, 0)) == "queued"  # the supervisor's restart leases the prompt again
    finally:
        sock.close(linger=0)
        server.stop()
        thread.join(timeout=30)
        ctx.term()
