"""An outside client against a real broker process: raw pyzmq + msgpack, no loraflow client code.

Everything here is built from the documented wire format alone (common/framing.py's docstring): frame 0 is the
8-byte preamble ``b"LFLW" | protocol version u16 | kind u16`` (big-endian), frame 1 a msgpack map of the
message's fields plus ``"tensors": [{name, dtype, shape, frame}]``, frames 2+ the raw tensor bytes; kind numbers
as common/protocol.py lists them. Each test is a case an outside client found, fixed at its root in the broker
or the wire layer:

- free-form fields nested near msgpack's limit (a group's ``metrics``, a heartbeat's ``counters``) crashed the
  broker when it re-encoded a Batch, and again after every restart: refused as malformed, naming the field;
- counters of any size made an 18-byte StatsRequest (no Hello needed) return megabytes: counters are at most 64
  numbers, Stats lists at most 256 workers and a burst of requests shares one encoded reply;
- parked long-polls were unbounded per worker and expired in O(n^2): one per worker, a newer one replaces it;
- a tensor spec whose dtype is a list was answered ``internal``;
- leases were not bound to their holder: a worker could submit for another worker's lease or a made-up one,
  and a refused group naming another worker's lease revoked it;
- an AdapterUpdate version >= 2^31 (tokens carry versions as int32) wedged the run;
- a malformed group kept its lease until lease_timeout_s; observers were unbounded; some decode errors had an
  empty detail.
"""

from __future__ import annotations

import hashlib
import struct
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from tests.support import Processes, start_broker, wait_for

PREAMBLE = struct.Struct("!4sHH")
VERSION = 1
HELLO, WELCOME, HEARTBEAT, ERROR, BYE = 1, 2, 3, 4, 5
LEASE_REQUEST, LEASE_GRANT = 10, 11
ROLLOUT_GROUP, ACK = 20, 21
ADAPTER_UPDATE = 30
BATCH_REQUEST, BATCH = 40, 41
STATS_REQUEST, STATS = 50, 51
GROUP_SIZE = 2
PROMPT_LEN, COMPLETION_LEN = 2, 3


def message(kind: int, fields: dict[str, Any], tensors: list[tuple[str, str, list[int], bytes]] = ()) -> list[bytes]:
    """The frames of one message: preamble, msgpack header (fields + tensor specs), tensor bytes."""
    specs = [{"name": name, "dtype": dtype, "shape": shape, "frame": i} for i, (name, dtype, shape, _) in
             enumerate(tensors)]
    return [PREAMBLE.pack(b"LFLW", VERSION, kind), msgpack.packb({**fields, "tensors": specs}),
            *(data for *_, data in tensors)]


def deep(levels: int, leaf: Any = 1) -> Any:
    """A map nested ``levels`` deep: {"a": {"a": ... leaf}}."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


class Client:
    """One DEALER socket speaking the wire format by hand."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 5.0, skip: tuple[int, ...] = (HEARTBEAT,)) -> tuple[int, dict[str, Any], list]:
        """(kind, header, tensor frames) of the next message not of a ``skip`` kind."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.sock.poll(left_ms), f"no reply within {timeout_s} s"
            frames = self.sock.recv_multipart()
            _, _, kind = PREAMBLE.unpack(frames[0])
            if kind not in skip:
                return kind, msgpack.unpackb(frames[1]), frames[2:]

    def ask(self, frames: list[bytes], timeout_s: float = 5.0) -> tuple[int, dict[str, Any]]:
        self.send(frames)
        kind, header, _ = self.recv(timeout_s)
        return kind, header

    def hello(self, role: str, client_id: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        return self.ask(message(HELLO, {"role": role, "client_id": client_id, "session": uuid.uuid4().hex, **fields}))

    def lease(self, max_leases: int = 1) -> list[dict[str, Any]]:
        kind, grant = self.ask(message(LEASE_REQUEST, {"max_leases": max_leases, "wait_ms": 0}))
        assert kind == LEASE_GRANT, grant
        return grant["leases"]


def group(lease: dict[str, Any], worker_id: str, **fields: Any) -> list[bytes]:
    """A valid RolloutGroup for ``lease`` (zero token ids and log-probs), with ``fields`` overriding the header."""
    n_prompt, n_completion = GROUP_SIZE * PROMPT_LEN, GROUP_SIZE * COMPLETION_LEN
    header = {"group_id": lease["group_id"], "lease_id": lease["lease_id"], "worker_id": worker_id,
              "prompt_lens": [PROMPT_LEN] * GROUP_SIZE, "completion_lens": [COMPLETION_LEN] * GROUP_SIZE,
              "rewards": [0.0, 1.0], "finish_reasons": ["stop"] * GROUP_SIZE, "min_version": 0, "max_version": 0,
              **fields}
    tensors = [("prompt_ids", "int32", [n_prompt], bytes(4 * n_prompt)),
               ("completion_ids", "int32", [n_completion], bytes(4 * n_completion)),
               ("logprobs", "float32", [n_completion], bytes(4 * n_completion)),
               ("versions", "int32", [n_completion], bytes(4 * n_completion)),
               ("loss_mask", "uint8", [n_completion], b"\x01" * n_completion)]
    return message(ROLLOUT_GROUP, header, tensors)


def stats(client: Client) -> dict[str, Any]:
    kind, reply = client.ask(message(STATS_REQUEST, {}))
    assert kind == STATS, reply
    return reply["snapshot"]


def learner_fields(run_dir: Path) -> dict[str, Any]:
    """What a learner's Hello must carry besides role and client id (the run token, when the broker wrote one)."""
    token_file = run_dir / "broker" / "run_token"
    return {"token": token_file.read_text().strip()} if token_file.is_file() else {}


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_deep_free_form_fields_are_malformed_and_the_broker_keeps_serving(procs: Processes, ctx: zmq.Context
                                                                         ) -> None:
    broker = start_broker(procs, f"run.group_size={GROUP_SIZE}", "run.groups_per_step=1",
                          "broker.heartbeat_interval_s=5")
    worker, learner, anyone = (Client(ctx, broker.endpoint, i) for i in (b"worker/w1", b"learner/l", b"observer/x"))
    assert worker.hello("worker", "w1")[0] == WELCOME
    assert learner.hello("learner", "learner", **learner_fields(broker.run_dir))[0] == WELCOME
    learner.send(message(BATCH_REQUEST, {"num_groups": 1, "wait_ms": 60_000}))  # parked: the group would serve it
    lease, = worker.lease()
    # ~1,022 levels: inside msgpack's own decode limit, over Python's recursion limit once re-encoded
    kind, error = worker.ask(group(lease, "w1", metrics=deep(1020)))
    assert kind == ERROR and error["code"] == "malformed" and "RolloutGroup.metrics" in error["message"], error
    assert error["ref_id"] == lease["group_id"]
    snapshot = stats(anyone)
    assert snapshot["leases"]["outstanding"] == 0, "a malformed group's lease goes back at once"
    assert snapshot["lease_events"].get("refused") == 1 and snapshot["prompts"]["queued"] >= 1
    for bad, field in [({"a": "text"}, "metrics['a']"), ({"x" * 65: 1}, "longer than 64"),
                       ({f"k{i}": i for i in range(65)}, "at most 64"), ({"a": [1, 2]}, "metrics['a']")]:
        lease, = worker.lease()
        kind, error = worker.ask(group(lease, "w1", metrics=bad))
        assert kind == ERROR and error["code"] == "malformed" and field in error["message"], (bad, error)
    # a heartbeat's counters: deep, or not numbers, or too many -> malformed; Stats keeps working
    for counters, field in [({"a": deep(1020)}, "Heartbeat.counters"), ({"a": "x" * 100_000}, "counters['a']"),
                            ({f"k{i}": 1 for i in range(65)}, "at most 64")]:
        kind, error = worker.ask(message(HEARTBEAT, {"counters": counters}))
        assert kind == ERROR and error["code"] == "malformed" and field in error["message"], error
    worker.send(message(HEARTBEAT, {"counters": {"tokens": 5, "busy_s": 1.5}}))
    wait_for(lambda: stats(anyone)["workers"][0]["counters"] == {"tokens": 5, "busy_s": 1.5}, 10, "the counters")
    # deep values elsewhere in a header: a Hello's id as a deep list, a lease request with a deep unknown field
    kind, error = anyone.ask(message(HELLO, {"role": "worker", "client_id": [[[[[]]]]] * 3}))
    assert kind == ERROR and error["code"] == "malformed" and "Hello.client_id" in error["message"], error
    # the parked batch request is served by the next good group: nothing was stuck, nobody crashed
    lease, = worker.lease()
    kind, ack = worker.ask(group(lease, "w1", metrics={"num_turns": 2}))
    assert kind == ACK and ack["status"] == "accepted", ack
    kind, batch, _ = learner.recv()
    assert kind == BATCH and [g["group"]["group_id"] for g in batch["groups"]] == [lease["group_id"]]
    snapshot = stats(anyone)
    assert broker.proc.alive() and snapshot["rejected"].get("internal") is None
    assert snapshot["rejected"]["malformed"] == 1 + 4 + 3 + 1


def test_stats_are_bounded_and_shared_and_long_polls_park_once_per_worker(procs: Processes, ctx: zmq.Context
                                                                         ) -> None:
    broker = start_broker(procs, f"run.group_size={GROUP_SIZE}", "run.groups_per_step=1", "run.max_staleness=0",
                          "broker.capacity_groups=1", "broker.heartbeat_interval_s=5", "broker.max_observers=1")
    anyone = Client(ctx, broker.endpoint, b"observer/anon")
    workers = [Client(ctx, broker.endpoint, f"worker/w{i}".encode()) for i in range(8)]
    big = {f"counter_{i:02d}_{'x' * 50}": 10 ** 15 + i for i in range(64)}  # the most a heartbeat may carry
    for i, worker in enumerate(workers):
        assert worker.hello("worker", f"w{i}")[0] == WELCOME
        worker.send(message(HEARTBEAT, {"counters": big}))
    wait_for(lambda: all(w["counters"] for w in stats(anyone)["workers"]), 10, "every worker's counters")
    # a burst of 18-byte requests from one socket, none read until all are sent: one encoded reply shared by all
    request = message(STATS_REQUEST, {})
    assert sum(map(len, request)) <= 18
    for _ in range(50):
        anyone.send(request)
    sizes = []
    for _ in range(50):
        kind, reply, _ = anyone.recv()
        assert kind == STATS and reply["snapshot"]["num_workers"] == 8
        sizes.append(len(msgpack.packb(reply)))
    assert max(sizes) < 8 * 8_000 + 20_000, max(sizes)  # ~5 kB of counters per worker at most, plus the rest

    # long-polls: the one lease there is goes out, then one worker parks thousands of requests
    first = workers[0]
    assert len(first.lease()) == 1
    greedy = workers[1]
    for _ in range(3000):
        greedy.send(message(LEASE_REQUEST, {"max_leases": 1, "wait_ms": 1500}))
    started = time.monotonic()
    wait_for(lambda: stats(anyone)["messages_in"].get("lease_request", 0) >= 3001, 30, "the requests to arrive")
    assert stats(anyone)["waiting"]["lease_requests"] == 1  # the newest replaced every older one
    kind, grant, _ = greedy.recv(timeout_s=10)  # only the newest is answered, empty, at its deadline
    assert kind == LEASE_GRANT and grant["leases"] == [] and time.monotonic() - started < 15
    assert not greedy.sock.poll(1000), "replaced requests are dropped, not answered"
    assert stats(anyone)["waiting"]["lease_requests"] == 0

    # observers are bounded by broker.max_observers (a StatsRequest needs no Hello at all)
    assert Client(ctx, broker.endpoint, b"observer/o1").hello("observer", "o1")[0] == WELCOME
    kind, error = Client(ctx, broker.endpoint, b"observer/o2").hello("observer", "o2")
    assert kind == ERROR and error["code"] == "limit" and "broker.max_observers" in error["message"], error


def test_leases_bind_their_holder_and_bad_specs_and_versions_are_malformed(procs: Processes, ctx: zmq.Context
                                                                           ) -> None:
    broker = start_broker(procs, f"run.group_size={GROUP_SIZE}", "run.groups_per_step=1",
                          "broker.heartbeat_interval_s=5")
    alice, mallory = Client(ctx, broker.endpoint, b"worker/alice"), Client(ctx, broker.endpoint, b"worker/mallory")
    anyone = Client(ctx, broker.endpoint, b"observer/anon")
    assert alice.hello("worker", "alice")[0] == WELCOME and mallory.hello("worker", "mallory")[0] == WELCOME
    lease, = alice.lease()
    # mallory submits for alice's live lease, then for alice's prompt under a made-up lease id
    for lease_id in (lease["lease_id"], "made-up", lease["lease_id"].rpartition(".")[0] + ".0000"):
        kind, error = mallory.ask(group({**lease, "lease_id": lease_id}, "mallory"))
        assert kind == ERROR and error["code"] == "unknown_lease" and "not granted to this client" in error["message"]
    # ... and a refused (invalid) group naming alice's lease: refused for the lease, which stays alice's
    kind, error = mallory.ask(group(lease, "mallory", min_version=5, max_version=5))
    assert kind == ERROR and error["code"] == "unknown_lease", error
    snapshot = stats(anyone)
    assert snapshot["leases"]["outstanding"] == 1 and snapshot["leases"]["list"][0]["worker"] == "worker/alice"
    assert snapshot["rejected"]["lease_not_yours"] == 4 and snapshot["group_events"].get("accepted") is None
    kind, ack = alice.ask(group(lease, "alice"))
    assert kind == ACK and ack["status"] == "accepted", ack

    # a tensor spec whose dtype (or frame) is a list or a map: malformed, never internal
    lease, = alice.lease()
    frames = group(lease, "alice")
    header = msgpack.unpackb(frames[1])
    for bad in ({"dtype": ["int32"]}, {"dtype": {"a": 1}}, {"frame": [0]}):
        header["tensors"][0] = {**header["tensors"][0], **bad}
        kind, error = alice.ask([frames[0], msgpack.packb(header), *frames[2:]])
        assert kind == ERROR and error["code"] == "malformed" and "tensors[0]" in error["message"], error
        header = msgpack.unpackb(frames[1])
    # a header that is no msgpack at all: the error says why
    kind, error = alice.ask([PREAMBLE.pack(b"LFLW", VERSION, HEARTBEAT), b"\x92\x01"])
    assert kind == ERROR and error["code"] == "malformed" and not error["message"].endswith(": "), error

    # versions travel as int32 in token tensors: a version >= 2^31 is malformed wherever it appears
    learner = Client(ctx, broker.endpoint, b"learner/l")
    assert learner.hello("learner", "learner", **learner_fields(broker.run_dir))[0] == WELCOME
    adapter = [("a", "float32", [2], bytes(8))]
    digest = hashlib.sha256(bytes(8)).hexdigest()
    kind, error = learner.ask(message(ADAPTER_UPDATE, {"version": 1 << 31, "sha256": digest, "adapter_config": {}},
                                      adapter))
    assert kind == ERROR and error["code"] == "malformed" and "AdapterUpdate.version" in error["message"], error
    kind, error = alice.ask(message(LEASE_REQUEST, {"adapter_version": 1 << 31}))
    assert kind == ERROR and "LeaseRequest.adapter_version: must be <= 2147483647" in error["message"], error
    kind, ack = learner.ask(message(ADAPTER_UPDATE, {"version": (1 << 31) - 1, "sha256": digest,
                                                     "adapter_config": {}}, adapter))
    assert kind == ACK, ack  # the largest version that fits is fine
    assert stats(anyone)["latest_version"] == (1 << 31) - 1 and broker.proc.alive()


def test_with_security_off_a_learner_session_needs_the_run_token(procs: Processes, ctx: zmq.Context) -> None:
    broker = start_broker(procs, f"run.group_size={GROUP_SIZE}", "broker.heartbeat_interval_s=5")
    token_file = broker.run_dir / "broker" / "run_token"
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token_file.stat().st_mode & 0o077 == 0  # random, readable by its owner only
    anyone = Client(ctx, broker.endpoint, b"observer/anon")
    for i, fields in enumerate([{}, {"token": ""}, {"token": token[:-1] + "x"}, {"token": token + " "}]):
        kind, error = Client(ctx, broker.endpoint, f"learner/l{i}".encode()).hello("learner", "learner", **fields)
        assert kind == ERROR and error["code"] == "forbidden" and "run token" in error["message"], error
    assert stats(anyone)["learner"] is None and stats(anyone)["rejected"] == {"run_token": 4}
    learner = Client(ctx, broker.endpoint, b"learner/real")
    assert learner.hello("learner", "learner", token=token)[0] == WELCOME
    kind, error = Client(ctx, broker.endpoint, b"learner/stray").hello("learner", "learner")
    assert kind == ERROR and error["code"] == "forbidden", error  # ... and cannot fence the real one
    assert stats(anyone)["learner"]["identity"] == "learner/real" and stats(anyone)["peers_gone"] == {}
    kind, batch = learner.ask(message(BATCH_REQUEST, {"num_groups": 1, "wait_ms": 0}))
    assert kind == BATCH, batch  # the real learner is still served
    assert Client(ctx, broker.endpoint, b"worker/w").hello("worker", "w")[0] == WELCOME  # workers need none

    # the token survives a restart; security.run_token sets it outright
    assert broker.proc.stop() == 0
    again = start_broker(procs, f"run.group_size={GROUP_SIZE}", run_dir=broker.run_dir, name="again")
    assert (again.run_dir / "broker" / "run_token").read_text().strip() == token
    assert Client(ctx, again.endpoint, b"learner/x").hello("learner", "learner", token=token)[0] == WELCOME
    assert again.proc.stop() == 0
    fixed = start_broker(procs, 'security.run_token="shared-secret"', name="fixed", run_dir=broker.run_dir / "f")
    assert Client(ctx, fixed.endpoint, b"learner/y").hello("learner", "learner", token="shared-secret")[0] == WELCOME
    kind, error = Client(ctx, fixed.endpoint, b"learner/z").hello("learner", "learner", token=token)
    assert kind == ERROR and error["code"] == "forbidden"
