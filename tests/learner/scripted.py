"""Test doubles for the learner: deterministic synthetic rollout groups and a scripted broker.

:func:`make_batch` builds the same Batch message for the same ``(seed, index)`` every time, so separate
learner processes (1 rank, 2 ranks, killed and resumed) can be fed identical batches.

:class:`Producer` plays a rollout worker against the real broker: it leases prompts and submits synthetic
groups for them at the adapter version it was last told about.

:class:`ScriptedBroker` is a ROUTER on a loopback port, served by a background thread, that speaks the
learner's side of the protocol like the broker does: Welcome, heartbeat pongs, long-polled BatchRequests
answered from :func:`make_batch` (at most ``allowed_batches``, in order; the sequence restarts at the version a
learner says hello with, so a resumed learner gets the batches that followed its checkpoint; or the frames
given as ``batches``, in order), and an Ack for
every AdapterUpdate and BatchAck. It records everything the learner sent for the test to inspect.

Its groups are random tokens with made-up log-probs and no evidence (``RolloutGroup.served``), which the
learner's policy check would refuse: learners fed by it run with ``integrity.check = false``. Groups that pass
the check come from :class:`Scorer`: tokens sampled from a reference Hugging Face model (the base, or the base
with a published adapter loaded through peft, as the hf backend loads one) and their log-probs as
:mod:`loraflow.common.logprobs` defines them; :func:`encode_groups` makes a Batch of them.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from loraflow.common import codec, framing
from loraflow.common.protocol import (
    AdapterAck,
    AdapterNotice,
    AdapterUpdate,
    Batch,
    BatchAck,
    BatchEntry,
    BatchRequest,
    BatchSettled,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Kind,
    LeaseGrant,
    LeaseRequest,
    RolloutGroup,
    ServedAdapter,
    Welcome,
)
from loraflow.common.transport import BrokerLink, Incoming, Reconnected

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
    return codec.encode(batch, tensors)


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
    batches: list[list[Any]] | None = None  # the frames of the batches to serve instead of make_batch's
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
                record, envelope = codec.decode(frames)
                with self._lock:
                    self._handle(identity.bytes, record, envelope)
            with self._lock:
                self._answer_waiting()

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        self.sock.send_multipart([identity, *frames], copy=False)

    def _handle(self, identity: bytes, record: Any, envelope: Any) -> None:
        if not isinstance(record, Hello) and identity not in self._registered:
            self._send(identity, codec.encode(Error(code="not_registered", message="say hello first",
                                                       ref_kind=int(record.KIND))))
            return
        if isinstance(record, Hello):
            self._registered.add(identity)
            self.hellos.append(record)
            self.next_index = record.adapter_version  # publish_every = 1: version == steps trained
            self._send(identity, codec.encode(Welcome(
                broker_id=self.broker_id, latest_version=self.latest_version, group_size=self.group_size,
                groups_per_step=self.num_groups, max_staleness=100, heartbeat_interval_s=0.2,
                heartbeat_timeout_s=2.0, lease_timeout_s=60, max_message_bytes=1 << 28, vocab_size=VOCAB)))
        elif isinstance(record, Heartbeat):
            self.heartbeats.append(record)
            self._send(identity, codec.encode(Heartbeat(latest_version=self.latest_version)))
        elif isinstance(record, AdapterUpdate):
            if record.version <= self.latest_version:
                self._send(identity, codec.encode(Error(code="stale_version", message="not newer",
                                                           ref_kind=Kind.ADAPTER_UPDATE, ref_id=str(record.version),
                                                           ref_version=record.version)))
                return
            self.latest_version = record.version
            tensors = {s.name: np.array(framing.as_numpy(s, envelope.frames[s.frame]))
                       for s in envelope.specs}
            self.published.append(Published(record.version, record.step, record.sha256, tensors,
                                            record.adapter_config))
            self._send(identity, codec.encode(AdapterAck(version=record.version)))
        elif isinstance(record, BatchRequest):
            self.num_requests += 1
            if self.refuse_requests:
                self._send(identity, codec.encode(Error(code=self.refuse_requests, message="refused",
                                                           ref_kind=Kind.BATCH_REQUEST)))
                return
            self._waiting.append((identity, record, time.monotonic() + record.wait_ms / 1000))
        elif isinstance(record, BatchAck):
            self.acks.append(record)
            if self.answer_batch_acks:
                self._send(identity, codec.encode(BatchSettled(ref_id=record.batch_id)))
        elif isinstance(record, Bye):
            self.byes.append(record)

    def _answer_waiting(self) -> None:
        now = time.monotonic()
        still = []
        for identity, request, deadline in self._waiting:
            limit = min(self.allowed_batches, len(self.batches)) if self.batches is not None else self.allowed_batches
            if self.next_index < limit:
                self.served.append(self.next_index)
                self._send(identity, self.batches[self.next_index] if self.batches is not None else make_batch(
                    self.seed, self.next_index, num_groups=request.num_groups, group_size=self.group_size,
                    latest_version=self.latest_version))
                self.next_index += 1
            elif now >= deadline:
                self._send(identity, codec.encode(Batch(latest_version=self.latest_version)))
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
            if isinstance(item, Reconnected):  # declared dead (a loaded box) and back: its parked request is gone
                asked = False
                continue
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


# -- groups whose log-probs come from a real model ----------------------------------------------------------------


class Scorer:
    """A reference policy in this process: the base model from ``model_dir``, or the base + a published adapter
    (PEFT-named tensors, as AdapterUpdate carries them), in float32."""

    def __init__(self, model_dir: Any, adapter: list[tuple[str, Any]] | None = None, lora_config: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if adapter is not None:
            from peft import get_peft_model, set_peft_model_state_dict

            model = get_peft_model(model, lora_config)
            set_peft_model_state_dict(model, dict(adapter))
        self.model = model.eval()

    def logprobs(self, prompt: Any, completion: Any, temperature: float) -> np.ndarray:
        """Behaviour log-probs of ``completion`` after ``prompt`` (int arrays) at ``temperature``."""
        import torch

        from loraflow.common.logprobs import token_logprobs

        tokens = torch.as_tensor(np.concatenate([prompt, completion]), dtype=torch.int64)[None]
        with torch.no_grad():
            logits = self.model(input_ids=tokens).logits[0, len(prompt) - 1:-1]
        return token_logprobs(logits, torch.as_tensor(completion, dtype=torch.int64), temperature).numpy()

    def sample(self, rng: np.random.Generator, prompt: Any, length: int, temperature: float) -> np.ndarray:
        """``length`` tokens sampled after ``prompt`` from softmax(logits / temperature), one token per forward
        after the prompt's (the KV cache holds the rest)."""
        import torch

        completion: list[int] = []
        with torch.no_grad():
            out = self.model(input_ids=torch.as_tensor(prompt, dtype=torch.int64)[None], use_cache=True)
            for _ in range(length):
                if completion:  # the previous token's forward, reading the cache
                    out = self.model(input_ids=torch.tensor([[completion[-1]]]), past_key_values=out.past_key_values,
                                     use_cache=True)
                probs = torch.softmax(out.logits[0, -1].double() / temperature, -1).numpy()
                completion.append(int(rng.choice(len(probs), p=probs / probs.sum())))
        return np.array(completion, dtype=np.int32)


@dataclass
class Sampled:
    """One sample: prompt and completion ids, behaviour log-probs, the version each token claims, the mask."""

    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    mask: np.ndarray


def sample_group(scorer: Scorer, rng: np.random.Generator, *, group_size: int, version: int,
                 temperature: float = 1.0, prompt_len: int = 6, completion_len: int = 12) -> list[Sampled]:
    """``group_size`` samples generated and scored by ``scorer``, every token claiming ``version``."""
    out = []
    for _ in range(group_size):
        prompt = rng.integers(3, VOCAB, prompt_len).astype(np.int32)
        completion = scorer.sample(rng, prompt, completion_len, temperature)
        out.append(Sampled(prompt, completion, scorer.logprobs(prompt, completion, temperature).astype(np.float32),
                           np.full(completion_len, version, dtype=np.int32), np.ones(completion_len, dtype=np.uint8)))
    return out


def served_for(version: int, sha256: str, *, lora_id: int | None = None, dtype: str = "float32") -> ServedAdapter:
    """The evidence an honest engine reports for ``version`` (v0: the base, no adapter)."""
    if version == 0:
        return ServedAdapter(version=0, dtype=dtype)
    return ServedAdapter(version=version, adapter=f"v{version}", lora_id=version if lora_id is None else lora_id,
                         sha256=sha256, dtype=dtype)


def rollout_group(group_id: str, samples: list[Sampled], served: list[ServedAdapter], *,
                  worker_id: str = "w") -> tuple[RolloutGroup, list]:
    """A RolloutGroup of these samples (rewards 1, 0, 1, ...: never all equal) and its tensors."""
    n = len(samples)
    versions = np.concatenate([s.versions for s in samples])
    group = RolloutGroup(group_id=group_id, lease_id=f"lease-{group_id}", worker_id=worker_id, task="arith",
                         prompt_lens=[len(s.prompt) for s in samples],
                         completion_lens=[len(s.completion) for s in samples],
                         rewards=[float((k + 1) % 2) for k in range(n)], finish_reasons=["length"] * n,
                         min_version=int(versions.min()), max_version=int(versions.max()), served=served)
    tensors = [("prompt_ids", np.concatenate([s.prompt for s in samples])),
               ("completion_ids", np.concatenate([s.completion for s in samples])),
               ("logprobs", np.concatenate([s.logprobs for s in samples])),
               ("versions", versions),
               ("loss_mask", np.concatenate([s.mask for s in samples]))]
    return group, tensors


def encode_groups(groups: list[tuple[RolloutGroup, list]], batch_id: str = "batch", latest_version: int = 0) -> list:
    """Frames of a Batch holding these groups."""
    entries, tensors = [], []
    for group, group_tensors in groups:
        entries.append(BatchEntry(group=group, first_tensor=len(tensors)))
        tensors.extend(group_tensors)
    return codec.encode(Batch(batch_id=batch_id, groups=entries, latest_version=latest_version), tensors)
