"""A barrage of malformed and forbidden messages: each is refused with the right Error and counted, and the
broker keeps serving with stats that account for every message."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgpack
import zmq

from loraflow.common import codec, framing, protocol, sockets
from loraflow.common.protocol import (
    AdapterUpdate,
    BatchAck,
    BatchRequest,
    Bye,
    Error,
    Hello,
    Kind,
    LeaseRequest,
    LeaseReturn,
    PromptLease,
    Welcome,
)
from tests.broker.clients import Learner, Worker, make_adapter, make_group
from tests.support import Processes, start_broker, wait_for

MAX_MESSAGE_BYTES = 256 << 10


class Raw:
    """A bare DEALER that sends whatever frames it is given."""

    def __init__(self, endpoint: str, identity: bytes) -> None:
        self.ctx = zmq.Context()
        self.sock = sockets.dealer_socket(self.ctx, endpoint, identity=identity)

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames)

    def reply(self, timeout_s: float = 5.0) -> object:
        assert self.sock.poll(int(timeout_s * 1000)), "no reply from the broker"
        return codec.decode(self.sock.recv_multipart())[0]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def preamble(kind: int, version: int = protocol.PROTOCOL_VERSION) -> bytes:
    return framing.PREAMBLE.pack(framing.MAGIC, version, kind)


def test_malformed_barrage_then_business_as_usual(procs: Processes, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"vocab_size": 64}')
    broker = start_broker(procs, "run.group_size=2", "run.groups_per_step=2", f'model.path="{model_dir}"',
                          f"broker.max_message_bytes={MAX_MESSAGE_BYTES}", "broker.heartbeat_interval_s=0.5")
    raw = Raw(broker.endpoint, b"worker/raw")
    expected: dict[str, int] = {}

    def refused(frames: list, code: str, contains: str = "") -> None:
        raw.send(frames)
        error = raw.reply()
        assert isinstance(error, Error) and error.code == code, (frames[:2], error)
        assert contains in error.message, error.message
        expected[code] = expected.get(code, 0) + 1

    hello = codec.encode(Hello(role="worker", client_id="raw", session=uuid.uuid4().hex))
    # framing: nothing of it can be trusted
    refused([b"hello"], "malformed", "at least 2 frames")
    refused([b"xx", b"yy"], "malformed", "preamble must be 8 bytes")
    refused([b"ABCD\x00\x01\x00\x01", b""], "malformed", "not a loraflow message")
    refused([preamble(Kind.HELLO, version=99), hello[1]], "protocol_version", "peer speaks 99, this process speaks 1")
    refused([preamble(999), b"\x80"], "malformed", "unknown message kind 999")
    refused([preamble(Kind.HELLO), b"\xc1"], "malformed", "not valid msgpack")
    refused([preamble(Kind.HELLO), msgpack.packb([1, 2])], "malformed", "must be a msgpack map")
    refused([preamble(Kind.HELLO), msgpack.packb({"role": "worker"})], "malformed", "client_id: required")
    refused(codec.encode(LeaseRequest()), "not_registered", "say Hello")
    chunk = bytes(100 << 10)
    refused([preamble(Kind.HELLO), msgpack.packb({"role": "worker", "client_id": "x", "tensors": []}), chunk, chunk,
             chunk], "oversize", "broker.max_message_bytes")

    raw.send(hello)
    assert isinstance(raw.reply(), Welcome)
    lease_grant = (raw.send(codec.encode(LeaseRequest(max_leases=3))), raw.reply())[1]
    first, second, third = lease_grant.leases

    group, tensors = make_group(first, "raw")
    frames = codec.encode(group, tensors)
    refused(frames[:2] + frames[3:] + frames[2:3], "malformed", "needs")  # tensor frames out of order
    refused(codec.encode(*make_group(first, "raw", logprob=float("nan"), vocab=64)), "invalid_group", "NaN")
    refused(codec.encode(*make_group(second, "raw", vocab=500)), "invalid_group", "outside [0, 64)")
    refused(codec.encode(LeaseReturn(lease_ids=["nope"])), "unknown_lease", "not held by you")
    bogus = PromptLease(lease_id="x", group_id="0:999", prompt_index=999, epoch=0, task="arith", prompt="?",
                        group_size=2, deadline_s=1)
    refused(codec.encode(*make_group(bogus, "raw")), "unknown_lease", "never leased")
    refused(codec.encode(*make_adapter(1)), "forbidden", "a worker may not send adapter_update")
    refused(codec.encode(BatchRequest(num_groups=1)), "forbidden", "batch_request")
    refused(codec.encode(BatchAck(batch_id="b", step=1, trained_version=0)), "forbidden", "batch_ack")
    refused(codec.encode(Welcome(broker_id="b", latest_version=0, group_size=1, groups_per_step=1,
                                    max_staleness=0, heartbeat_interval_s=1, heartbeat_timeout_s=1,
                                    lease_timeout_s=1, max_message_bytes=1 << 20)), "forbidden", "sent by the broker")
    raw.send(codec.encode(Error(code="internal", message="an error is never answered")))
    expected["forbidden"] += 1

    learner_raw = Raw(broker.endpoint, b"learner/raw")
    learner_raw.send(codec.encode(Hello(role="learner", client_id="raw", session="s", token=broker.run_token)))
    assert isinstance(learner_raw.reply(), Welcome)
    for frames, code, contains in [
        (codec.encode(BatchAck(batch_id="gone", step=1, trained_version=0)), "unknown_batch", "lists no group_ids"),
        (codec.encode(AdapterUpdate(version=1, sha256="00" * 32, adapter_config={}),
                         [("a", make_adapter(1)[1][0][1])]), "malformed", "sha256"),
        ([preamble(Kind.ADAPTER_UPDATE), msgpack.packb({"version": 0, "sha256": "", "adapter_config": {},
                                                        "tensors": []})], "malformed", "must be >= 1"),
    ]:
        learner_raw.send(frames)
        error = learner_raw.reply()
        assert error.code == code and contains in error.message, error
        expected[code] = expected.get(code, 0) + 1

    stats = broker.stats()
    assert stats["rejected"] == expected
    assert stats["num_rejected"] == sum(expected.values()) == 23
    assert stats["messages_in"]["undecodable"] == 9  # the ones that failed framing (no kind to count them under)

    # one frame over MAXMSGSIZE: zmq drops the connection before the broker sees a byte
    big = Raw(broker.endpoint, b"worker/big")
    big.send([bytes(MAX_MESSAGE_BYTES + 1)])
    wait_for(lambda: broker.stats()["connections"].get("disconnected", 0) >= 1, 10, "zmq to drop the sender", procs)
    big.close()
    raw.close()
    learner_raw.send(codec.encode(Bye(reason="done")))  # (else the learner below replaces and fences it)
    wait_for(lambda: broker.stats()["learner"] is None, 10, "the raw learner's goodbye", procs)
    learner_raw.close()

    # ... and everything still works, stats included
    worker, learner = Worker(broker.endpoint, "w1"), Learner(broker.endpoint, token=broker.run_token)
    try:
        for lease in worker.lease(2).leases:
            worker.submit(lease, vocab=64)
            assert worker.reply().status == "accepted"
        batch = learner.batch(2).record
        assert len(batch.groups) == 2 and learner.ack(batch).KIND == Kind.ACK
        stats = broker.stats()
        assert stats["num_rejected"] == 23 and stats["group_events"]["trained"] == 2
        assert stats["prompts"]["trained_total"] == 2 and len(stats["workers"]) == 2  # raw + w1
    finally:
        worker.close()
        learner.close()
