"""An in-process BrokerCore driven with real encoded messages (no sockets): fast, exact tests of semantics.

``Harness.send(identity, record, tensors)`` encodes a message exactly as a client would, hands the frames to
``BrokerCore.handle`` and returns the decoded replies that ``flush`` releases for everyone, waiting for the
state writer when replies depend on a write. The clock is explicit (``harness.now``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from loraflow.broker.core import BrokerCore
from loraflow.broker.snapshot import build_snapshot
from loraflow.common import codec, protocol
from loraflow.common.config import load_config
from loraflow.common.protocol import Hello, LeaseRequest, PromptLease
from loraflow.common.tasks import load_task
from tests.broker.clients import make_adapter, make_group

W1, W2, LEARNER = b"worker/w1", b"worker/w2", b"learner/learner"


class Harness:
    def __init__(self, *overrides: str, state_path: Path | None = None, vocab_size: int = 200) -> None:
        self.overrides = ("run.group_size=2", "run.groups_per_step=2", "run.max_staleness=1",
                          "broker.lease_timeout_s=10", "broker.heartbeat_interval_s=1", *overrides)
        self.config = load_config(None, list(self.overrides))
        self.now = 1000.0
        self.state_path = state_path
        self.vocab_size = vocab_size
        self.core = self._new_core()
        self.failing: set[bytes] = set()  # identities whose sends fail (peer gone)

    def _new_core(self) -> BrokerCore:
        return BrokerCore(self.config, task=load_task(self.config.run.task, self.config.run.seed),
                          vocab_size=self.vocab_size, state_path=self.state_path, now_s=self.now)

    def restart(self) -> None:
        """A crash: whatever is durable on disk is all the new core knows."""
        self.core = self._new_core()

    def flush(self) -> list[tuple[bytes, Any, Any]]:
        """(identity, record, envelope) of everything the core sends now, after writes it waits for."""
        replies = []
        deadline = time.monotonic() + 10
        while True:
            self.core.tick(self.now)
            for out in self.core.flush(self.now):
                if out.identity in self.failing:
                    self.core.send_failed(out, "unreachable")
                    continue
                record, envelope = codec.decode(out.frames)
                replies.append((out.identity, record, envelope))
            if not self.core.outbox.num_awaiting and not self.core.has_work(self.now):
                return replies
            assert time.monotonic() < deadline, "the state writer did not finish"
            time.sleep(0.001)

    def send(self, identity: bytes, record: Any, tensors: Any = ()) -> list[tuple[bytes, Any, Any]]:
        self.core.handle(identity, codec.encode(record, list(tensors)), self.now)
        return self.flush()

    def send_frames(self, identity: bytes, frames: list[Any]) -> list[tuple[bytes, Any, Any]]:
        self.core.handle(identity, frames, self.now)
        return self.flush()

    def advance(self, seconds: float) -> list[tuple[bytes, Any, Any]]:
        self.now += seconds
        return self.flush()

    # -- conveniences ----------------------------------------------------------------------------------------

    def hello(self, identity: bytes, adapter_version: int = 0, session: str = "s1") -> list:
        role, client_id = identity.decode().split("/")
        return self.send(identity, Hello(role=role, client_id=client_id, session=session,
                                         adapter_version=adapter_version))

    def lease(self, identity: bytes, n: int = 1, adapter_version: int = 0, wait_ms: int = 0) -> list[PromptLease]:
        replies = self.send(identity, LeaseRequest(max_leases=n, adapter_version=adapter_version, wait_ms=wait_ms))
        grants = [r for i, r, _ in replies if i == identity and r.KIND == protocol.Kind.LEASE_GRANT]
        return grants[0].leases if grants else []

    def submit(self, identity: bytes, lease: PromptLease, **kwargs: Any) -> Any:
        record, tensors = make_group(lease, identity.decode(), **kwargs)
        return self.reply_to(identity, self.send(identity, record, tensors))

    def publish(self, version: int, tensors: Any = None, identity: bytes = LEARNER) -> Any:
        record, tensors = make_adapter(version, tensors)
        return self.reply_to(identity, self.send(identity, record, tensors))

    @staticmethod
    def reply_to(identity: bytes, replies: list) -> Any:
        mine = [r for i, r, _ in replies if i == identity and r.KIND in (protocol.Kind.ACK, protocol.Kind.ERROR)]
        assert len(mine) == 1, f"expected one Ack/Error for {identity!r}, got {replies}"
        return mine[0]

    def stats(self) -> dict:
        return build_snapshot(self.core, self.now)
