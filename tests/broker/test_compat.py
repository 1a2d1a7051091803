"""The compatibility rule within one protocol version (common/protocol.py), against a real BrokerCore: a newer
client's unknown fields are ignored and counted (``unknown_fields{kind}``), an older client's missing defaulted
fields take their defaults, and another protocol version is refused naming both. The clients here write their
headers by hand with msgpack, as any outside client would."""

from __future__ import annotations

import msgpack
import numpy as np

from loraflow.common import codec, framing, protocol
from loraflow.common.protocol import PROTOCOL_VERSION, AdapterAck, Error, GroupAck, Kind
from tests.broker.clients import group_tensors
from tests.broker.harness import LEARNER, W1, Harness


def raw(kind: int, header: dict, tensors: list = (), version: int = PROTOCOL_VERSION) -> list:
    """Frames of a message written by hand: preamble, msgpack header (+ tensor specs), tensor bytes."""
    specs = [{"name": name, "dtype": array.dtype.name, "shape": list(array.shape), "frame": i}
             for i, (name, array) in enumerate(tensors)]
    return [framing.PREAMBLE.pack(framing.MAGIC, version, kind), msgpack.packb({**header, "tensors": specs}),
            *(array.tobytes() for _, array in tensors)]


def group_header(lease: protocol.PromptLease, **fields: object) -> dict:
    """The fields of a RolloutGroup as the oldest client sends them: the required ones only."""
    n = lease.group_size
    return {"group_id": lease.group_id, "lease_id": lease.lease_id, "worker_id": "w1", "prompt_lens": [4] * n,
            "completion_lens": [6] * n, "rewards": [0.0, 1.0][:n], "finish_reasons": ["stop"] * n,
            "min_version": 0, "max_version": 0, **fields}


def reply(replies: list, identity: bytes, kind: int) -> object:
    mine = [r for i, r, _ in replies if i == identity and r.KIND in (kind, Kind.ERROR)]
    assert len(mine) == 1, replies
    return mine[0]


def test_a_newer_clients_unknown_fields_are_ignored_and_counted() -> None:
    h = Harness()
    welcome = reply(h.send_frames(W1, raw(Kind.HELLO, {"role": "worker", "client_id": "w1", "session": "s",
                                                       "capabilities": ["zstd"]})), W1, Kind.WELCOME)
    assert welcome.KIND == Kind.WELCOME
    lease, = h.lease(W1)
    # unknown fields at the top and inside a nested record (a served adapter), tensors as they always were
    header = group_header(lease, engine_stats={"kv_hit": 0.5}, served=[{"version": 0, "engine": "vllm-99"}])
    ack = reply(h.send_frames(W1, raw(Kind.ROLLOUT_GROUP, header, group_tensors(2, prompt_len=4, completion_len=6))),
                W1, Kind.ACK)
    assert isinstance(ack, GroupAck) and ack.ref_id == lease.group_id and ack.status == "accepted", ack
    assert h.stats()["unknown_fields"] == {"hello": 1, "rollout_group": 1}
    # what the learner gets holds only fields this release knows
    h.hello(LEARNER)
    batch_replies = h.send(LEARNER, protocol.BatchRequest(num_groups=1, wait_ms=0))
    (_, batch, envelope), = [r for r in batch_replies if r[0] == LEARNER and r[1].KIND == Kind.BATCH]
    assert [e.group.group_id for e in batch.groups] == [lease.group_id] and not envelope.unknown_fields
    assert b"engine_stats" not in bytes(envelope.header_bytes) and b"vllm-99" not in bytes(envelope.header_bytes)


def test_an_older_clients_missing_defaulted_fields_take_their_defaults() -> None:
    h = Harness()
    reply(h.send_frames(W1, raw(Kind.HELLO, {"role": "worker", "client_id": "w1"})), W1, Kind.WELCOME)
    lease, = h.lease(W1)
    ack = reply(h.send_frames(W1, raw(Kind.ROLLOUT_GROUP, group_header(lease),
                                      group_tensors(2, prompt_len=4, completion_len=6))), W1, Kind.ACK)
    assert isinstance(ack, GroupAck) and ack.status == "accepted", ack
    assert "unknown_fields" not in h.stats() or not h.stats()["unknown_fields"]
    # a required field is still required, and a bounded one still bounded, however new the client
    lease, = h.lease(W1)
    header = group_header(lease, newer=1)
    del header["rewards"]
    error = reply(h.send_frames(W1, raw(Kind.ROLLOUT_GROUP, header, group_tensors(2, prompt_len=4, completion_len=6))),
                  W1, Kind.ACK)
    assert isinstance(error, Error) and error.code == "malformed", error
    assert "RolloutGroup.rewards: required field is missing" in error.message, error.message


def test_another_protocol_version_is_refused_naming_both() -> None:
    h = Harness()
    error = reply(h.send_frames(W1, raw(Kind.HELLO, {"role": "worker", "client_id": "w1"},
                                        version=PROTOCOL_VERSION + 1)), W1, Kind.WELCOME)
    assert isinstance(error, Error) and error.code == "protocol_version", error
    assert f"peer speaks {PROTOCOL_VERSION + 1}, this process speaks {PROTOCOL_VERSION}" in error.message


def test_replies_are_typed_and_read_by_an_old_client_as_before() -> None:
    """GroupAck and AdapterAck share kind ACK, told apart by ref_kind; an AdapterAck carries an int version and
    still the ref_id text an older learner read."""
    h = Harness()
    h.hello(LEARNER)
    ack = h.publish(1)
    assert isinstance(ack, AdapterAck) and ack.version == 1, ack
    frames = codec.encode(ack)
    assert msgpack.unpackb(frames[1]) == {"ref_kind": Kind.ADAPTER_UPDATE, "version": 1, "ref_id": "1", "tensors": []}
    # a tensor spec is framing, not a record: an unknown key in one is still refused
    spec_frames = raw(Kind.HEARTBEAT, {})
    spec_frames[1] = msgpack.packb({"tensors": [{"name": "x", "dtype": "uint8", "shape": [1], "frame": 0, "z": 1}]})
    error = reply(h.send_frames(LEARNER, [*spec_frames, np.zeros(1, np.uint8).tobytes()]), LEARNER, Kind.HEARTBEAT)
    assert isinstance(error, Error) and error.code == "malformed" and "tensors[0]" in error.message, error
