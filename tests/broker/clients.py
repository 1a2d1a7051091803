"""Scripted clients for broker integration tests: a worker and a learner over BrokerLink, groups and adapters.

They speak the real protocol through :class:`loraflow.common.transport.BrokerLink` (hello, heartbeats and reconnects
in its I/O thread) and wait with bounded timeouts for the reply they expect, failing with what arrived instead.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import numpy as np

from loraflow.common.protocol import (
    AdapterFetch,
    AdapterUpdate,
    BatchAck,
    BatchRequest,
    Hello,
    Kind,
    LeaseRequest,
    LeaseReturn,
    PromptLease,
    RolloutGroup,
)
from loraflow.common.transport import BrokerLink, Incoming, Reconnected

FAST = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)


def group_tensors(num_samples: int, *, prompt_len: int = 4, completion_len: int = 6, version: int = 0,
                  vocab: int = 200, logprob: float = -0.5, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    num_completion = num_samples * completion_len
    return [
        ("prompt_ids", rng.integers(0, vocab, num_samples * prompt_len, dtype=np.int32)),
        ("completion_ids", rng.integers(0, vocab, num_completion, dtype=np.int32)),
        ("logprobs", np.full(num_completion, logprob, dtype=np.float32)),
        ("versions", np.full(num_completion, version, dtype=np.int32)),
        ("loss_mask", np.ones(num_completion, dtype=np.uint8)),
    ]


def make_group(lease: PromptLease, worker_id: str, *, version: int = 0, prompt_len: int = 4,
               completion_len: int = 6, **tensor_kwargs: Any) -> tuple[RolloutGroup, list[tuple[str, np.ndarray]]]:
    n = lease.group_size
    record = RolloutGroup(group_id=lease.group_id, lease_id=lease.lease_id, worker_id=worker_id, task=lease.task,
                          prompt_lens=[prompt_len] * n, completion_lens=[completion_len] * n,
                          rewards=[float(i % 2) for i in range(n)], finish_reasons=["stop"] * n,
                          min_version=version, max_version=version)
    return record, group_tensors(n, prompt_len=prompt_len, completion_len=completion_len, version=version,
                                 **tensor_kwargs)


def adapter_tensors(num_floats: int = 1024, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    half = num_floats // 2
    return [("base_model.model.layers.0.q_proj.lora_A.weight", rng.standard_normal(half, dtype=np.float32)),
            ("base_model.model.layers.0.q_proj.lora_B.weight", rng.standard_normal(num_floats - half,
                                                                                   dtype=np.float32))]


def make_adapter(version: int, tensors: list[tuple[str, np.ndarray]] | None = None) -> tuple[AdapterUpdate, list]:
    tensors = tensors if tensors is not None else adapter_tensors(seed=version)
    digest = hashlib.sha256()
    for _, array in tensors:
        digest.update(array.tobytes())
    return AdapterUpdate(version=version, step=version, sha256=digest.hexdigest(),
                         adapter_config={"r": 8, "lora_alpha": 16, "peft_type": "LORA"}), tensors


class Client:
    """A BrokerLink plus bounded waits for a given message kind."""

    def __init__(self, endpoint: str, role: str, client_id: str | None = None, *, adapter_version: int = 0,
                 capacity: int = 4, session: str = "", security: Any = None, token: str = "") -> None:
        self.client_id = client_id or f"{role}-{uuid.uuid4().hex[:6]}"
        self.link = BrokerLink(endpoint, Hello(role=role, client_id=self.client_id, capacity=capacity,
                                               adapter_version=adapter_version, session=session, token=token),
                               security=security, **FAST)
        self.welcome = self.link.start(timeout_s=10)

    def expect(self, *kinds: Kind, timeout_s: float = 5.0) -> Incoming:
        item = self.link.recv(timeout_s=timeout_s, kinds=kinds)
        assert item is not None, f"{self.client_id}: no {[k.name for k in kinds]} within {timeout_s} s"
        assert isinstance(item, Incoming), f"{self.client_id}: got {item} while waiting for {kinds}"
        return item

    def expect_reconnected(self, timeout_s: float = 10.0) -> Reconnected:
        while True:
            item = self.link.recv(timeout_s=timeout_s, kinds=[Kind.WELCOME])
            assert item is not None, f"{self.client_id}: no Reconnected within {timeout_s} s"
            if isinstance(item, Reconnected):
                return item

    def nothing(self, *kinds: Kind, timeout_s: float = 0.3) -> None:
        item = self.link.recv(timeout_s=timeout_s, kinds=kinds)
        assert item is None, f"{self.client_id}: expected nothing, got {item}"

    def close(self) -> None:
        self.link.close()


class Worker(Client):
    def __init__(self, endpoint: str, client_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(endpoint, "worker", client_id, **kwargs)
        self.adapter_version = self.link.hello.adapter_version

    def request(self, max_leases: int = 1, wait_ms: int = 0) -> None:
        self.link.send(LeaseRequest(max_leases=max_leases, adapter_version=self.adapter_version, wait_ms=wait_ms))

    def lease(self, max_leases: int = 1, wait_ms: int = 0, timeout_s: float = 5.0) -> Any:
        """Send a LeaseRequest and return the LeaseGrant record."""
        self.request(max_leases, wait_ms)
        return self.expect(Kind.LEASE_GRANT, timeout_s=timeout_s + wait_ms / 1000).record

    def submit(self, lease: PromptLease, **kwargs: Any) -> None:
        record, tensors = make_group(lease, self.client_id, version=kwargs.pop("version", self.adapter_version),
                                     **kwargs)
        self.link.send(record, tensors)

    def reply(self, timeout_s: float = 5.0) -> Any:
        """The next Ack or Error record."""
        return self.expect(Kind.ACK, Kind.ERROR, timeout_s=timeout_s).record

    def give_back(self, *lease_ids: str) -> None:
        self.link.send(LeaseReturn(lease_ids=list(lease_ids)))

    def fetch(self, version: int = 0) -> Incoming:
        self.link.send(AdapterFetch(version=version))
        return self.expect(Kind.ADAPTER_UPDATE, Kind.ERROR)


class Learner(Client):
    """A learner; ``token``: the broker's run token (``BrokerHandle.run_token``), needed while security is off."""

    def __init__(self, endpoint: str, client_id: str = "learner", **kwargs: Any) -> None:
        super().__init__(endpoint, "learner", client_id, **kwargs)

    def request(self, num_groups: int, wait_ms: int = 0, learner_version: int = 0) -> None:
        self.link.send(BatchRequest(num_groups=num_groups, wait_ms=wait_ms, learner_version=learner_version))

    def batch(self, num_groups: int, wait_ms: int = 0, timeout_s: float = 5.0) -> Incoming:
        self.request(num_groups, wait_ms)
        return self.expect(Kind.BATCH, Kind.ERROR, timeout_s=timeout_s + wait_ms / 1000)

    def ack(self, batch: Any, step: int = 1, group_ids: list[str] | None = None, trained_version: int = 0) -> Any:
        ids = [e.group.group_id for e in batch.groups] if group_ids is None else group_ids
        self.link.send(BatchAck(batch_id=batch.batch_id, step=step, trained_version=trained_version, group_ids=ids))
        return self.expect(Kind.ACK, Kind.ERROR).record

    def publish(self, version: int, tensors: list | None = None) -> Any:
        record, tensors = make_adapter(version, tensors)
        self.link.send(record, tensors)
        return self.expect(Kind.ACK, Kind.ERROR, timeout_s=10).record
