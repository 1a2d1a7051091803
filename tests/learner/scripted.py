"""Test doubles for the learner: deterministic synthetic rollout groups and a scripted broker.

:func:`make_batch` builds the same Batch message for the same ``(seed, index)`` every time, so separate
learner processes (1 rank, 2 ranks, killed and resumed) can be fed identical batches.

:class:`Producer` plays a rollout worker against the real broker: it leases prompts and submits synthetic
groups for them at the adapter version it was last told about.

:class:`ScriptedBroker` is a ROUTER on a loopback port, served by a background thread, that speaks the
learner's side of the protocol like the broker does: Welcome, heartbeat pongs, long-polled BatchRequests
answered from :func:`make_batch` (at most ``allowed_batches``, in order; the sequence restarts at the version a
learner says hello with, so a resumed learner gets the batches that followed its checkpoint), and an Ack for
every AdapterUpdate and BatchAck. It records everything the learner sent for the test to inspect.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from common import framing, protocol
from common.protocol import (
    Ack,
    AdapterNotice,
    AdapterUpdate,
    Batch,
    BatchAck,
    BatchEntry,
    BatchRequest,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Kind,
    LeaseGrant,
    LeaseRequest,
    RolloutGroup,
    Welcome,
)
from common.transport import BrokerLink, Incoming

VOCAB = 259  # the tiny model's


def make_group(rng: np.random.Generator, group_id: str, *, group_size: int, min_version: int = 0,
               vocab: int = VOCAB, max_prompt: int = 12, max_completion: int = 20) -> tuple[RolloutGroup, list]:
    """A group with random tokens, log-probs near the uniform policy's, 0/1 rewards (never all equal)."""
    prompt_lens = [int(x) for x in rng.integers(2, max_prompt + 1, group_size)]
    completion_lens = [int(x) for x in rng.integers(1, max_completion + 1, group_size)]
    num_completion = sum(completion_lens)
    rewards = [float(x) for x in rng.integers(0, 2, group_size)]
    rewards[0], rewards[-1] = 1.0, 0.0
    mask = (rng.random(num_completion) < 0.9).astype(np.uint8)
    logprobs = (-math.log(vocab) + rng.normal(0, 0.3, num_completion)).clip(max=0).astype(np.float32) * mask
    tensors = [
        ("prompt_ids", rng.integers(0, vocab, sum(prompt_lens), dtype=np.int32)),
        ("completion_ids", rng.integers(0, vocab, num_completion, dtype=np.int32)),
        ("logprobs", logprobs),
        ("versions", np.full(num_completion, min_version, dtype=np.int32)),
        ("loss_mask", mask),
    ]
    group = RolloutGroup(group_id=group_id, lease_id=f"lease-{group_id}", worker_id="scripted", task="arith",
                         prompt_lens=prompt_lens, completion_lens=completion_lens, rewards=rewards,
                         finish_reasons=["stop"] * group_size, min_version=min_version, max_version=min_version)
    return group, tensors


def make_batch(seed: int, index: int, *, num_groups: int, group_size: int, min_version: int = 0,
               latest_version: int = 0) -> list[Any]:
    """Frames of Batch ``index``: its groups are ``"<index>:<k>"``, identical for the same (seed, index)."""
    rng = np.random.default_rng([seed, index])
    entries, tensors = [], []
    for k in range(num_groups):
        group, group_tensors = make_group(rng, f"{index}:{k}", group_size=group_size, min_version=min_version)
        entries.append(BatchEntry(group=group, first_tensor=len(tensors)))
        tensors.extend(group_tensors)
    batch = Batch(batch_id=f"batch-{index}", groups=entries, latest_version=latest_version)
    return protocol.encode(batch, tensors)


@dataclass
class Published:
    version: int
    step: int
    sha256: str
    tensors: dict[str, np.ndarray]
    adapter_config: dict[str, Any]


@dataclass
class ScriptedBroker:
    seed: int = 0
    num_groups: int = 2
    group_size: int = 4
    allowed_batches: int = 1 << 30
    broker_id: str = "scripted"
    port: int = 0  # 0 = any free port
    answer_batch_acks: bool = True
    refuse_requests: str = ""  # an Error code to answer every BatchRequest with
    num_requests: int = 0
    hellos: list[Hello] = field(default_factory=list)
    published: list[Published] = field(default_factory=list)
    acks: list[BatchAck] = field(default_factory=list)
    served: list[int] = field(default_factory=list)
    byes: list[Bye] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.port:  # a restarted broker on the port of a closed one: zmq releases it asynchronously
            deadline = time.monotonic() + 5
            while True:
                try:
                    self.sock.bind(f"tcp://127.0.0.1:{self.port}")
                    break
                except zmq.ZMQError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        else:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.latest_version = 0
        self.next_index = 0
        self._waiting: list[tuple[bytes, BatchRequest, float]] = []
        self._registered: set[bytes] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="scripted-broker", daemon=True)
        self._thread.start()

    # -- for the test --------------------------------------------------------------------------------------

    def allow(self, num_batches: int) -> None:
        with self._lock:
            self.allowed_batches = num_batches

    def forget_waiting(self) -> None:
        """Drop parked batch requests (their learner was killed; a real broker drops a gone peer's waits)."""
        with self._lock:
            self._waiting.clear()

    def by_step(self) -> dict[int, Published]:
        """The newest publication of each step (a resumed learner publishes some steps again)."""
        with self._lock:
            return {p.step: p for p in self.published}

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(0)

    # -- the serving thread --------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                identity, *frames = self.sock.recv_multipart(copy=False)
                record, envelope = protocol.decode(frames)
                with self._lock:
                    self._handle(identity.bytes, record, envelope)
            with self._lock:
                self._answer_waiting()

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        self.sock.send_multipart([identity, *frames], copy=False)

    def _handle(self, identity: bytes, record: Any, envelope: Any) -> None:
        if not isinstance(record, Hello) and identity not in self._registered:
            self._send(identity, protocol.encode(Error(code="not_registered", message="say hello first",
                                                       ref_kind=int(record.KIND))))
            return
        if isinstance(record, Hello):
            self._registered.add(identity)
            self.hellos.append(record)
            self.next_index = record.adapter_version  # publish_every = 1: version == steps trained
            self._send(identity, protocol.encode(Welcome(
                broker_id=self.broker_id, latest_version=self.latest_version, group_size=self.group_size,
                groups_per_step=self.num_groups, max_staleness=100, heartbeat_interval_s=0.2,
                heartbeat_timeout_s=2.0, lease_timeout_s=60, max_message_bytes=1 << 28, vocab_size=VOCAB)))
        elif isinstance(record, Heartbeat):
            self.heartbeats.append(record)
            self._send(identity, protocol.encode(Heartbeat(latest_version=self.latest_version)))
        elif isinstance(record, AdapterUpdate):
            if record.version <= self.latest_version:
                self._send(identity, protocol.encode(Error(code="stale_version", message="not newer",
                                                           ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(record.version))))
                return
            self.latest_version = record.version
            tensors = {s.name: np.array(framing.as_numpy(s, envelope.frames[s.frame]))
                       for s in envelope.specs}
            self.published.append(Published(record.version, record.step, record.sha256, tensors,
                                            record.adapter_config))
            self._send(identity, protocol.encode(Ack(ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(record.version))))
        elif isinstance(record, BatchRequest):
            self.num_requests += 1
            if self.refuse_requests:
                self._send(identity, protocol.encode(Error(code=self.refuse_requests, message="refused",
                                                           ref_kind=Kind.BATCH_REQUEST)))
                return
            self._waiting.append((identity, record, time.monotonic() + record.wait_ms / 1000))
        elif isinstance(record, BatchAck):
            self.acks.append(record)
            if self.answer_batch_acks:
                self._send(identity, protocol.encode(Ack(ref_kind=Kind.BATCH_ACK, ref_id=record.batch_id)))
        elif isinstance(record, Bye):
            self.byes.append(record)

    def _answer_waiting(self) -> None:
        now = time.monotonic()
        still = []
        for identity, request, deadline in self._waiting:
            if self.next_index < self.allowed_batches:
                self.served.append(self.next_index)
                self._send(identity, make_batch(self.seed, self.next_index, num_groups=request.num_groups,
                                                group_size=self.group_size, latest_version=self.latest_version))
                self.next_index += 1
            elif now >= deadline:
                self._send(identity, protocol.encode(Batch(latest_version=self.latest_version)))
            else:
                still.append((identity, request, deadline))
        self._waiting = still


class Producer(threading.Thread):
    """A scripted worker: leases prompts, submits random groups at its adapter version, follows AdapterNotices."""

    def __init__(self, endpoint: str, *, max_prompt: int = 12, max_completion: int = 20) -> None:
        super().__init__(name="producer", daemon=True)
        self.lengths = {"max_prompt": max_prompt, "max_completion": max_completion}
        self.link = BrokerLink(endpoint, Hello(role="worker", client_id="producer", capacity=64),
                               heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
        self.version = 0
        self.notices: list[int] = []
        self.errors: list[Error] = []
        self.stop = threading.Event()

    def run(self) -> None:
        rng = np.random.default_rng(0)
        self.link.start(timeout_s=10)
        asked = False
        while not self.stop.is_set():
            if not asked:
                self.link.send(LeaseRequest(max_leases=16, adapter_version=self.version, wait_ms=200))
                asked = True
            item = self.link.recv(timeout_s=0.1)
            if not isinstance(item, Incoming):
                continue
            record = item.record
            if isinstance(record, LeaseGrant):
                asked = False
                for lease in record.leases:
                    group, tensors = make_group(rng, lease.group_id, group_size=lease.group_size,
                                                min_version=self.version, **self.lengths)
                    group.lease_id, group.worker_id = lease.lease_id, "producer"
                    self.link.send(group, tensors)
            elif isinstance(record, AdapterNotice):
                self.notices.append(record.version)
                self.version = max(self.version, record.version)
            elif isinstance(record, AdapterUpdate):
                self.version = max(self.version, record.version)
            elif isinstance(record, Error):
                self.errors.append(record)
        self.link.close()
