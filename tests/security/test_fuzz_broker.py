"""Property-based fuzzing of a broker process over its socket: whatever arrives, the broker answers, never
crashes, never corrupts its buffer, and its counters account for every message and every refusal.

tests/common fuzzes each decoder in-process and tests/broker/test_bad_input.py sends a fixed barrage; here
hypothesis drives a real ``python -m loraflow.broker`` through raw DEALER sockets (no client-side checks in the way):

- random frames, with and without a valid preamble, from registered and unregistered identities;
- valid messages of every kind a client sends, truncated (frames dropped, a frame cut short);
- rollout groups with tensor specs of the wrong dtype or shape, frames of the wrong size, huge declared sizes;
- rollout groups with random tensor contents for real leases (out-of-range ids, NaN, bad versions and masks);
- batch acks replayed, for unknown batches, listing random group ids.

After every example the live picture must be consistent (prompt states match the buffer and the lease table,
memory accounting matches the groups held), and each test ends by checking that ``messages_in`` counts every
message sent and ``rejected`` every Error received; a worker and a learner then still complete a round trip.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from loraflow.common import codec, framing, protocol, sockets
from loraflow.common.protocol import (
    BatchAck,
    BatchRequest,
    Error,
    Hello,
    Kind,
    LeaseRequest,
    LeaseReturn,
    PromptLease,
)
from loraflow.common.transport import fetch_stats
from tests.broker.clients import Learner, Worker, make_adapter, make_group
from tests.support import Processes, start_broker

VOCAB = 64
GROUP_SIZE = 2
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
CLIENT_KINDS = [Kind.HELLO, Kind.HEARTBEAT, Kind.BYE, Kind.LEASE_REQUEST, Kind.LEASE_RETURN, Kind.ROLLOUT_GROUP,
                Kind.ADAPTER_FETCH, Kind.ADAPTER_UPDATE, Kind.BATCH_REQUEST, Kind.BATCH_ACK, Kind.STATS_REQUEST]


class Raw:
    """A bare DEALER; counts what it sends and the Errors it gets back."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes) -> None:
        self.sock = sockets.dealer_socket(ctx, endpoint, identity=identity)
        self.num_sent = 0
        self.num_errors = 0
        self.num_error_kind_sent = 0  # Error messages sent to the broker: counted as rejected, never answered

    def send(self, frames: list[Any]) -> list[Any]:
        """Send one message; every reply that arrives (the first within 2 s, then any already there)."""
        self.sock.send_multipart(frames)
        self.num_sent += 1
        unanswered = _peek_kind(frames) == Kind.ERROR and len(frames[0]) == framing.PREAMBLE.size
        if unanswered:
            self.num_error_kind_sent += 1
        replies = []
        timeout_ms = 200 if unanswered else 2000  # (a reply that should not come would still be caught)
        while self.sock.poll(timeout_ms):
            record, _ = codec.decode(self.sock.recv_multipart())
            if record.KIND != Kind.HEARTBEAT:
                replies.append(record)
                self.num_errors += isinstance(record, Error)
            timeout_ms = 5
        return replies

    def ask(self, record: Any, tensors: Any = ()) -> list[Any]:
        return self.send(codec.encode(record, list(tensors)))


def _peek_kind(frames: list[Any]) -> int:
    try:
        magic, _, kind = framing.PREAMBLE.unpack(bytes(frames[0]))
    except Exception:  # not a preamble at all
        return 0
    return kind if magic == framing.MAGIC else 0


class Fuzz:
    """The broker under test, the raw clients fuzzing it, and the consistency checks."""

    def __init__(self, procs: Processes, model_dir: Path) -> None:
        self.broker = start_broker(procs, f"run.group_size={GROUP_SIZE}", "run.groups_per_step=1",
                                   "run.max_staleness=1000", "broker.capacity_groups=4096", f'model.path="{model_dir}"',
                                   "broker.max_leases_per_worker=4096", "broker.heartbeat_interval_s=60",
                                   "broker.heartbeat_misses=100",
                                   f"broker.max_message_bytes={1 << 20}")
        self.ctx = zmq.Context()
        self.num_stats = 0
        self.stranger = Raw(self.ctx, self.broker.endpoint, b"worker/stranger")  # never says Hello
        self.worker = Raw(self.ctx, self.broker.endpoint, b"worker/fuzz")
        self.learner = Raw(self.ctx, self.broker.endpoint, b"learner/fuzz")
        self.worker.ask(Hello(role="worker", client_id="fuzz", session=uuid.uuid4().hex, capacity=1024))
        self.learner.ask(Hello(role="learner", client_id="fuzz", session=uuid.uuid4().hex,
                               token=self.broker.run_token))

    @property
    def clients(self) -> list[Raw]:
        return [self.stranger, self.worker, self.learner]

    def stats(self) -> dict[str, Any]:
        self.num_stats += 1
        return fetch_stats(self.broker.endpoint, timeout_s=5, ctx=self.ctx)

    def lease(self) -> PromptLease | None:
        grants = [r for r in self.worker.ask(LeaseRequest(max_leases=1, wait_ms=0)) if r.KIND == Kind.LEASE_GRANT]
        return grants[0].leases[0] if grants and grants[0].leases else None

    def check_consistent(self) -> dict[str, Any]:
        assert self.broker.proc.alive(), self.broker.proc.log()[-3000:]
        s = self.stats()
        prompts, buffer = s["prompts"], s["buffer"]
        assert prompts["buffered"] == buffer["groups"], (prompts, buffer)
        assert prompts["training"] == buffer["training_groups"], (prompts, buffer)
        assert prompts["leased"] == s["leases"]["outstanding"], (prompts, s["leases"])
        held = buffer["groups"] + buffer["training_groups"]
        assert buffer["memory_bytes"] >= buffer["bytes"] + buffer["training_bytes"] and (held or not buffer["bytes"])
        assert all(v >= 0 for v in prompts.values() if isinstance(v, int))
        return s

    def check_accounting(self) -> None:
        s = self.check_consistent()
        sent = sum(c.num_sent for c in self.clients)
        assert sum(s["messages_in"].values()) == sent + self.num_stats, s["messages_in"]
        refused = sum(c.num_errors + c.num_error_kind_sent for c in self.clients)
        assert s["num_rejected"] == refused, (s["rejected"], refused)
        assert sum(s["rejected"].values()) == s["num_rejected"]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    tmp = tmp_path_factory.mktemp("fuzz")
    procs = Processes(tmp)
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(f'{{"vocab_size": {VOCAB}}}')
    f = Fuzz(procs, model)
    try:
        yield f
        f.check_accounting()
        # business as usual after everything
        worker, learner = Worker(f.broker.endpoint, "after"), Learner(f.broker.endpoint, "learner", token=f.broker.run_token)
        try:
            lease, = worker.lease(1).leases
            worker.submit(lease, vocab=VOCAB)
            assert worker.reply().status == "accepted"
            stats = f.stats()
            batch = learner.batch(stats["buffer"]["groups"]).record
            assert lease.group_id in [e.group.group_id for e in batch.groups]
            assert learner.ack(batch).KIND == Kind.ACK
            f.check_consistent()
        finally:
            worker.close()
            learner.close()
    finally:
        f.close()
        procs.cleanup()


# -- strategies ----------------------------------------------------------------------------------------------

frames_st = st.lists(st.binary(max_size=64), min_size=1, max_size=5)
preambles = st.builds(lambda kind, version: framing.PREAMBLE.pack(framing.MAGIC, version, kind),
                      st.sampled_from([*CLIENT_KINDS, Kind.ERROR, Kind.WELCOME, Kind.BATCH, 999]),
                      st.sampled_from([protocol.PROTOCOL_VERSION, protocol.PROTOCOL_VERSION + 1]))


def valid_messages(lease_id: str = "L", group_id: str = "0:0") -> list[list[Any]]:
    lease = PromptLease(lease_id=lease_id, group_id=group_id, prompt_index=0, epoch=0, task="arith", prompt="1+1=",
                        group_size=GROUP_SIZE, deadline_s=10)
    return [
        codec.encode(*make_group(lease, "fuzz", vocab=VOCAB)),
        codec.encode(*make_adapter(1)),
        codec.encode(Hello(role="worker", client_id="fuzz", session="x")),
        codec.encode(LeaseRequest(max_leases=2, wait_ms=0)),
        codec.encode(LeaseReturn(lease_ids=["a", "b"])),
        codec.encode(BatchAck(batch_id="b", step=1, trained_version=0, group_ids=["0:1"])),
        codec.encode(BatchRequest(num_groups=1, wait_ms=0)),
    ]


# -- properties ----------------------------------------------------------------------------------------------


@FUZZ
@given(who=st.sampled_from(["stranger", "worker", "learner"]), frames=frames_st, preamble=st.none() | preambles)
def test_random_frames(fuzz: Fuzz, who: str, frames: list[bytes], preamble: bytes | None) -> None:
    if preamble is not None:
        frames = [preamble, *frames]
    replies = getattr(fuzz, who).send(frames)
    if _peek_kind(frames) != Kind.ERROR:
        assert [r.KIND for r in replies] == [Kind.ERROR], replies
    fuzz.check_consistent()


@FUZZ
@given(data=st.data())
def test_truncated_messages(fuzz: Fuzz, data: st.DataObject) -> None:
    frames = [bytes(memoryview(f)) for f in data.draw(st.sampled_from(valid_messages()))]
    if data.draw(st.booleans()) and len(frames) > 2:
        frames = frames[:data.draw(st.integers(1, len(frames) - 1))]  # frames dropped
    else:
        i = data.draw(st.integers(0, len(frames) - 1))
        assume(len(frames[i]) > 0)
        frames[i] = frames[i][:data.draw(st.integers(0, len(frames[i]) - 1))]  # one frame cut short
    who = data.draw(st.sampled_from(["worker", "learner"]))
    replies = getattr(fuzz, who).send(frames)
    assert len(replies) == 1 and replies[0].KIND == Kind.ERROR, replies
    assert replies[0].code in ("malformed", "forbidden", "protocol_version"), replies[0]
    fuzz.check_consistent()


@FUZZ
@given(data=st.data())
def test_wrong_dtypes_shapes_and_huge_sizes(fuzz: Fuzz, data: st.DataObject) -> None:
    frames = [bytes(memoryview(f)) for f in valid_messages()[0]]
    header = msgpack.unpackb(frames[1])
    spec = header["tensors"][data.draw(st.integers(0, len(header["tensors"]) - 1))]
    change = data.draw(st.sampled_from(["dtype", "shape", "huge", "frame_size"]))
    if change == "dtype":
        spec["dtype"] = data.draw(st.sampled_from(sorted(framing.DTYPE_SIZES) + ["complex64", "object", ""]))
    elif change == "shape":
        spec["shape"] = data.draw(st.lists(st.integers(-3, 40), max_size=3))
    elif change == "huge":
        spec["shape"] = [data.draw(st.integers(2**31, 2**39))]
    else:
        frames[2 + spec["frame"]] += data.draw(st.binary(min_size=1, max_size=16))
    frames[1] = msgpack.packb(header)
    unchanged = frames == [bytes(memoryview(f)) for f in valid_messages()[0]]
    assume(not unchanged)
    before = fuzz.stats()["buffer"]
    replies = fuzz.worker.send(frames)
    assert len(replies) == 1 and replies[0].KIND == Kind.ERROR, replies
    assert replies[0].code in ("malformed", "unknown_lease"), replies[0]  # the same layout, another dtype name
    after = fuzz.check_consistent()["buffer"]
    assert (after["groups"], after["bytes"]) == (before["groups"], before["bytes"])


@FUZZ
@given(ids=st.lists(st.integers(-2**40, 2**40), min_size=1, max_size=8), logprob=st.floats(width=32, allow_nan=True),
       version=st.integers(0, 2**31 - 1), mask=st.integers(0, 255), vocab=st.sampled_from([VOCAB, 1 << 20]))
def test_random_group_contents_for_real_leases(fuzz: Fuzz, ids: list[int], logprob: float, version: int, mask: int,
                                               vocab: int) -> None:
    lease = fuzz.lease()
    assume(lease is not None)
    record, tensors = make_group(lease, "fuzz", vocab=vocab, logprob=logprob)
    tensors = dict(tensors)
    completion = tensors["completion_ids"]
    completion[:min(len(ids), completion.size)] = np.array(ids, dtype=np.int64)[:completion.size].astype(np.int32)
    tensors["versions"][-1] = version % (1 << 31)
    tensors["loss_mask"][0] = mask
    record.max_version = int(tensors["versions"].max())
    before = fuzz.stats()["prompts"]
    replies = fuzz.worker.ask(record, list(tensors.items()))
    assert len(replies) == 1, replies
    reply = replies[0]
    valid = (0 <= completion.min() and completion.max() < VOCAB and tensors["prompt_ids"].max() < VOCAB
             and math.isfinite(logprob) and logprob <= 1e-3 and mask <= 1 and record.max_version == 0)
    if valid:
        assert reply.KIND == Kind.ACK and reply.status == "accepted", reply
    else:
        assert reply.KIND == Kind.ERROR and reply.code == "invalid_group", reply
        after = fuzz.check_consistent()["prompts"]
        assert after["queued"] == before["queued"] + 1  # the prompt goes back to the queue, nothing buffered
        assert after["buffered"] == before["buffered"]


@FUZZ
@given(acks=st.lists(st.tuples(st.sampled_from(["served", "replay", "unknown"]),
                               st.lists(st.sampled_from(["0:0", "0:3", "0:03", "²:1", "0:999999", "7:1", "x", "", "0:-1"])
                                        | st.from_regex(r"[0-9]{1,3}:[0-9]{1,3}", fullmatch=True), max_size=4)),
                     min_size=1, max_size=4))
def test_replayed_and_unknown_batch_acks(fuzz: Fuzz, acks: list[tuple[str, list[str]]]) -> None:
    served: list[Any] = []
    for kind, group_ids in acks:
        if kind == "served":
            lease = fuzz.lease()
            assume(lease is not None)
            assert fuzz.worker.ask(*make_group(lease, "fuzz", vocab=VOCAB))[0].KIND == Kind.ACK
            batches = [r for r in fuzz.learner.ask(BatchRequest(num_groups=1, wait_ms=0)) if r.KIND == Kind.BATCH]
            assert batches and batches[0].groups
            served.append(batches[0])
            ack = BatchAck(batch_id=batches[0].batch_id, step=1, trained_version=0,
                           group_ids=[e.group.group_id for e in batches[0].groups])
        elif kind == "replay" and served:
            batch = served[-1]
            ack = BatchAck(batch_id=batch.batch_id, step=1, trained_version=0,
                           group_ids=[e.group.group_id for e in batch.groups])
        else:
            ack = BatchAck(batch_id=f"unknown-{uuid.uuid4().hex[:6]}", step=1, trained_version=0, group_ids=group_ids)
        replies = fuzz.learner.ask(ack)
        assert len(replies) == 1, replies
        codes = Counter((r.KIND, getattr(r, "code", None)) for r in replies)
        if ack.group_ids:
            assert codes == {(Kind.ACK, None): 1}, replies
        else:
            assert codes == {(Kind.ERROR, "unknown_batch"): 1}, replies
        fuzz.check_consistent()


@FUZZ
@given(depth=st.integers(1, 1000), where=st.sampled_from(["metrics", "reward_means", "counters"]),
       as_list=st.booleans())
def test_free_form_fields_nested_to_any_depth(fuzz: Fuzz, depth: int, where: str, as_list: bool) -> None:
    """Nested values in a group's metrics / reward_means or a heartbeat's counters, up to msgpack's own limit:
    refused as malformed naming the field (the lease goes back at once), never internal, never a crash."""
    value: Any = 1.0
    for _ in range(depth):
        value = [value] if as_list else {"a": value}
    if where == "counters":
        replies = fuzz.worker.send([framing.PREAMBLE.pack(framing.MAGIC, protocol.PROTOCOL_VERSION, Kind.HEARTBEAT),
                                    msgpack.packb({"counters": {"c": value}})])
        assert [(r.KIND, r.code) for r in replies] == [(Kind.ERROR, "malformed")], replies
        assert "Heartbeat.counters" in replies[0].message
        fuzz.check_consistent()
        return
    lease = fuzz.lease()
    assume(lease is not None)
    frames = [bytes(memoryview(f)) for f in codec.encode(*make_group(lease, "fuzz", vocab=VOCAB))]
    frames[1] = msgpack.packb({**msgpack.unpackb(frames[1]), where: {"m": value}})  # (schema.dump would recurse)
    leased = fuzz.stats()["leases"]["outstanding"]
    replies = fuzz.worker.send(frames)
    assert [(r.KIND, r.code) for r in replies] == [(Kind.ERROR, "malformed")], replies
    assert f"RolloutGroup{'.' + where if where == 'metrics' else ''}" in replies[0].message, replies[0].message
    assert fuzz.check_consistent()["leases"]["outstanding"] == leased - 1  # returned at once
