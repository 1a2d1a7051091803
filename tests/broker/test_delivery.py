"""Nothing lost, nothing trained twice: random runs with crashes of the broker, against the protocol's promises.

A scripted worker (keeps groups until acked, re-sends after a broker restart, sometimes forgets a lease) and a
scripted learner (acks every batch, re-sends unconfirmed acks after a restart) drive an in-process core; the
"crash" replaces the core by a new one that knows only what is durable on disk. Checked at the end:

- every prompt of the (finite) dataset was trained;
- no group was served to the learner after the broker had confirmed (Ack'd) a BatchAck covering it;
- no prompt outside the dataset was ever leased.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.common.protocol import AdapterFetch, BatchAck, BatchRequest, Kind, LeaseRequest
from tests.broker.clients import make_adapter, make_group
from tests.broker.harness import LEARNER, W1, Harness

NUM_PROMPTS = 12
ACTIONS = ["lease", "submit", "submit", "batch", "expire", "forget", "publish", "crash"]


class Run:
    def __init__(self, state_dir: Path, max_staleness: int) -> None:
        self.h = Harness("run.group_size=2", "run.groups_per_step=2", f"run.max_staleness={max_staleness}",
                         f"broker.prompt_limit={NUM_PROMPTS}", "broker.num_epochs=1", "broker.lease_timeout_s=3",
                         "broker.heartbeat_interval_s=60", state_path=state_dir / "state.json")
        self.held: dict[str, object] = {}  # leases the worker holds
        self.unacked_groups: dict[str, tuple] = {}  # submitted, not acknowledged
        self.unacked_batch_acks: dict[str, BatchAck] = {}
        self.confirmed: set[str] = set()  # group ids whose BatchAck the broker acknowledged
        self.trained: dict[str, int] = {}
        self.violations: list[str] = []
        self.leased_ids: set[str] = set()
        self.worker_version = 0
        self.learner_version = 0
        self.step = 0
        self.connect()

    def connect(self) -> None:
        self.handle(self.h.hello(W1, adapter_version=self.worker_version))
        self.handle(self.h.hello(LEARNER, adapter_version=self.learner_version))

    def handle(self, replies: list) -> None:
        for identity, record, _ in replies:
            kind = record.KIND
            if kind == Kind.LEASE_GRANT:
                for lease in record.leases:
                    self.held[lease.group_id] = lease
                    self.leased_ids.add(lease.group_id)
            elif kind in (Kind.ACK, Kind.ERROR) and record.ref_kind == Kind.ROLLOUT_GROUP:
                self.unacked_groups.pop(record.ref_id, None)  # accepted, duplicate or refused: done
            elif kind == Kind.ACK and record.ref_kind == Kind.BATCH_ACK:
                ack = self.unacked_batch_acks.pop(record.ref_id, None)
                if ack is not None:
                    self.confirmed.update(ack.group_ids)
            elif kind == Kind.BATCH and record.groups:
                self.train(record)
            elif kind in (Kind.ADAPTER_NOTICE, Kind.ADAPTER_UPDATE) and identity == W1:
                self.worker_version = max(self.worker_version, getattr(record, "version", 0))

    def train(self, batch) -> None:
        self.step += 1
        ids = [entry.group.group_id for entry in batch.groups]
        for group_id in ids:
            if group_id in self.confirmed:
                self.violations.append(f"{group_id} served after its training was confirmed")
            self.trained[group_id] = self.trained.get(group_id, 0) + 1
        ack = BatchAck(batch_id=batch.batch_id, step=self.step, trained_version=self.learner_version,
                       group_ids=ids)
        self.unacked_batch_acks[batch.batch_id] = ack
        self.handle(self.h.send(LEARNER, ack))

    def act(self, action: str, rng: random.Random) -> None:
        h = self.h
        if action == "lease":
            self.handle(h.send(W1, LeaseRequest(max_leases=rng.randint(1, 3), adapter_version=self.worker_version)))
        elif action == "submit" and self.held:
            lease = self.held.pop(rng.choice(sorted(self.held)))
            record, tensors = make_group(lease, "w1", version=self.worker_version)
            self.unacked_groups[lease.group_id] = (record, tensors)
            self.handle(h.send(W1, record, tensors))
        elif action == "forget" and self.held:
            self.held.pop(rng.choice(sorted(self.held)))  # a worker that died mid-generation
        elif action == "batch":
            self.handle(h.send(LEARNER, BatchRequest(num_groups=2, learner_version=self.learner_version)))
        elif action == "expire":
            self.handle(h.advance(3.5))
        elif action == "publish":
            self.learner_version = max(self.learner_version, h.core.latest_version) + 1
            self.handle(h.send(LEARNER, *make_adapter(self.learner_version)))
            self.handle(h.send(W1, AdapterFetch()))
        elif action == "crash":
            h.restart()
            self.connect()
            for record, tensors in list(self.unacked_groups.values()):
                self.handle(h.send(W1, record, tensors))
            for ack in list(self.unacked_batch_acks.values()):
                self.handle(h.send(LEARNER, ack))
            if h.core.latest_version < self.learner_version:  # the adapter was lost with the old process
                self.handle(h.send(LEARNER, *make_adapter(self.learner_version)))

    def finish(self) -> None:
        """Run without crashes until every prompt is trained (publishing when admission needs a new version)."""
        rng = random.Random(0)
        for _ in range(100):
            if len(self.confirmed) == NUM_PROMPTS:
                return
            trained_before = len(self.confirmed)
            self.act("lease", rng)
            while self.held:
                self.act("submit", rng)
            self.act("batch", rng)
            if len(self.confirmed) == trained_before:
                self.act("publish", rng)
                self.act("expire", rng)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), num_actions=st.integers(5, 60), max_staleness=st.sampled_from([0, 1, 3]))
def test_every_prompt_trained_once_across_crashes(seed: int, num_actions: int, max_staleness: int) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp), max_staleness)
        for _ in range(num_actions):
            run.act(rng.choice(ACTIONS), rng)
        run.finish()
    expected = {f"0:{i}" for i in range(NUM_PROMPTS)}
    assert run.violations == []
    assert run.confirmed == expected
    assert run.leased_ids <= expected
