"""Learner restarts, withdrawn versions and the end of a dataset, exactly, on an in-process broker core.

The real-process suite (test_kill_*.py) shows the invariant holds when processes die at random points; these
tests pin down each rule it relies on, one message at a time (tests/broker/harness.py: real encoded messages,
an explicit clock, a restart that keeps only what is on disk).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraflow.broker.history import TrainingHistory
from loraflow.common.protocol import AdapterFetch, BatchAck, BatchRequest, Kind, LeaseRequest
from tests.broker.clients import adapter_tensors, make_group
from tests.broker.harness import LEARNER, W1, W2, Harness

pytestmark = pytest.mark.fault


def fill(h: Harness, n: int, version: int, worker: bytes = W1) -> list[str]:
    leases = h.lease(worker, n, adapter_version=version)
    assert len(leases) == n
    for lease in leases:
        assert h.submit(worker, lease, version=version).status == "accepted"
    return [lease.group_id for lease in leases]


def train_step(h: Harness, step: int, trained_version: int, checkpoint_version: int) -> list[str]:
    """Serve a batch of 2, acknowledge it as trained on ``trained_version``, publish trained_version + 1."""
    (_, batch, _), = h.send(LEARNER, BatchRequest(num_groups=2, learner_version=trained_version))
    ids = [e.group.group_id for e in batch.groups]
    h.send(LEARNER, BatchAck(batch_id=batch.batch_id, step=step, trained_version=trained_version, group_ids=ids,
                             checkpoint_version=checkpoint_version))
    assert h.publish(trained_version + 1).KIND == Kind.ACK
    return ids


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    harness = Harness("run.max_staleness=4", "broker.capacity_groups=16", state_path=tmp_path / "state.json")
    harness.hello(W1)
    harness.hello(LEARNER, session="first")
    return harness


def three_steps(h: Harness) -> tuple[list[str], list[str], list[str]]:
    """Steps 1-3 trained on versions 0, 1, 2 (published 1, 2, 3); the learner checkpointed at version 1."""
    fill(h, 2, 0)
    first = train_step(h, 1, trained_version=0, checkpoint_version=0)
    fill(h, 2, 1)
    second = train_step(h, 2, trained_version=1, checkpoint_version=1)  # the checkpoint of step 1 (version 1)
    fill(h, 2, 2)
    third = train_step(h, 3, trained_version=2, checkpoint_version=1)
    return first, second, third


def test_learner_resumed_from_an_older_checkpoint(h: Harness) -> None:
    first, second, third = three_steps(h)
    assert h.stats()["history"]["uncommitted_groups"] == 4  # steps 2 and 3: no checkpoint covers them
    late = h.lease(W1, 1, adapter_version=3)  # a worker on version 3, generating
    buffered_v3 = fill(h, 1, 3)
    h.hello(W2)
    buffered_v1 = fill(h, 1, 1, worker=W2)

    replies = h.hello(LEARNER, adapter_version=1, session="second")  # resumed from the checkpoint of version 1
    assert [r.KIND for i, r, _ in replies if i == LEARNER] == [Kind.WELCOME]
    stats = h.stats()
    assert stats["history"]["withdrawn"] == [[2, 3]]
    assert stats["group_events"]["rolled_back"] == 4 and stats["prompts"]["trained_total"] == 2
    assert stats["dropped"] == {"withdrawn": 1}  # the buffered group of version 3; the version-1 one stays
    assert [a["version"] for a in stats["adapters"]] == [1]
    assert stats["buffer"]["groups"] == 1 and h.core.ledger.buffered()[0].group_id == buffered_v1[0]
    requeued = {*second, *third, *buffered_v3}
    assert {f"{k[0]}:{k[1]}" for k in h.core.ledger.pending_keys()
            if h.core.ledger.state(k) == "queued"} == requeued

    # a worker still on version 3 gets no lease and no version-3 adapter; its late group is refused
    (_, grant, _), = h.send(W1, LeaseRequest(max_leases=1, adapter_version=3))
    assert grant.leases == [] and grant.reason == "stale_adapter"
    (_, update, _), = h.send(W1, AdapterFetch())
    assert update.version == 1
    error = h.submit(W1, late[0], version=3)
    assert error.code == "invalid_group" and "withdrawn" in error.message
    assert h.stats()["rejected"]["withdrawn"] == 1

    # numbers are never reused: not 3 again, not 2; the resumed learner's next version is 4
    assert h.publish(3).code == "stale_version"
    assert h.publish(4).KIND == Kind.ACK
    assert {lease.group_id for lease in h.lease(W1, 6, adapter_version=4)} == requeued | {late[0].group_id}


def test_the_rollback_survives_a_broker_restart(h: Harness) -> None:
    three_steps(h)
    h.hello(LEARNER, adapter_version=1, session="second")
    h.restart()
    h.hello(W1)
    h.hello(LEARNER, adapter_version=1, session="second")  # the same learner process: nothing happens again
    stats = h.stats()
    assert stats["history"] == {"uncommitted_groups": 0, "withdrawn": [[2, 3]], "learner_session": "second"}
    assert stats["prompts"]["trained_total"] == 2 and "rolled_back" not in stats["group_events"]
    assert stats["adapters"] == [] and h.core.latest_version == 3  # adapter.bin held version 3: not served
    assert h.publish(3).code == "stale_version" and h.publish(4).KIND == Kind.ACK


def test_uncommitted_records_survive_a_broker_restart(h: Harness) -> None:
    first, second, third = three_steps(h)
    h.restart()
    h.hello(W1)
    h.hello(LEARNER, adapter_version=3, session="first")  # the learner lives on: no rollback
    assert h.stats()["history"]["uncommitted_groups"] == 4
    h.hello(LEARNER, adapter_version=1, session="third")  # ... until it dies and resumes at version 1
    assert h.stats()["group_events"]["rolled_back"] == 4
    assert h.stats()["prompts"]["queued"] >= 4


def test_a_checkpoint_commits(h: Harness) -> None:
    three_steps(h)
    fill(h, 2, 3)
    train_step(h, 4, trained_version=3, checkpoint_version=3)  # the checkpoint of step 3 is version 3
    assert h.stats()["history"]["uncommitted_groups"] == 2  # only step 4's groups
    h.hello(LEARNER, adapter_version=3, session="second")  # resumed from that checkpoint
    stats = h.stats()
    assert stats["group_events"]["rolled_back"] == 2 and stats["history"]["withdrawn"] == [[4, 4]]
    assert h.publish(5).KIND == Kind.ACK  # the resumed learner's weights under a new number
    fill(h, 2, 5)
    train_step(h, 4, trained_version=5, checkpoint_version=3)
    assert h.stats()["history"]["uncommitted_groups"] == 2
    fill(h, 2, 6)
    train_step(h, 5, trained_version=6, checkpoint_version=7)  # a checkpoint that holds step 5 itself
    assert h.stats()["history"]["uncommitted_groups"] == 0


def test_fresh_learner_session_without_rollback(h: Harness) -> None:
    first, *_ = three_steps(h)
    h.hello(LEARNER, adapter_version=3, session="second")  # resumed from a checkpoint at the newest version
    stats = h.stats()
    assert stats["history"]["withdrawn"] == [] and [a["version"] for a in stats["adapters"]] == [1, 2, 3]
    assert stats["group_events"].get("rolled_back", 0) == 0 and stats["prompts"]["trained_total"] == 6


def test_a_version_lost_with_the_broker_comes_back_only_with_the_same_weights(tmp_path: Path) -> None:
    h = Harness(state_path=tmp_path / "state.json")
    h.hello(W1)
    h.hello(LEARNER)
    tensors = adapter_tensors(seed=1)
    assert h.publish(1, tensors).KIND == Kind.ACK
    (tmp_path / "adapter.bin").unlink()  # the frames are lost, the state file names version 1
    h.restart()
    h.hello(LEARNER)
    error = h.publish(1, adapter_tensors(seed=2))
    assert error.code == "stale_version" and "other weights" in error.message
    assert h.publish(1, tensors).KIND == Kind.ACK and h.stats()["adapter_events"] == {"restored": 1}


def test_the_last_groups_of_the_dataset_come_as_a_short_batch() -> None:
    h = Harness("broker.prompt_limit=3", "broker.num_epochs=1", "run.max_staleness=4")
    h.hello(W1)
    h.hello(LEARNER)
    leases = h.lease(W1, 3)
    for lease in leases[:2]:
        h.submit(W1, lease)
    assert h.send(LEARNER, BatchRequest(num_groups=2))[0][1].groups  # a full batch
    assert h.send(LEARNER, BatchRequest(num_groups=2, wait_ms=60_000)) == []  # 0:2 is still leased: wait
    record, tensors = make_group(leases[2], "w1")
    replies = h.send(W1, record, tensors)
    batches = [r for i, r, _ in replies if r.KIND == Kind.BATCH]
    assert [[e.group.group_id for e in b.groups] for b in batches] == [["0:2"]]


def test_history_records_are_ordered_and_bounded() -> None:
    history = TrainingHistory(max_records=3)
    for i, version in enumerate([0, 0, 1, 2]):
        history.record((0, i), version)
    assert list(history.uncommitted) == [(0, 1), (0, 2), (0, 3)] and history.num_overflowed == 1
    assert history.commit(1) == 1 and list(history.uncommitted) == [(0, 2), (0, 3)]
    assert history.rollback(2) == [(0, 3)] and not history.uncommitted
    assert history.withdraw(3, 5) and history.withdraw(6, 6) and not history.withdraw(4, 5)
    assert history.withdrawn == [(3, 6)] and history.is_withdrawn(6) and not history.is_withdrawn(2)
    assert TrainingHistory(max_records=0).record((0, 0), 1) is None


def test_no_records_without_learner_checkpoints() -> None:
    h = Harness("learner.checkpoint_every=0", "run.max_staleness=4")
    h.hello(W1)
    h.hello(LEARNER)
    fill(h, 2, 0)
    train_step(h, 1, trained_version=0, checkpoint_version=0)
    assert h.stats()["history"]["uncommitted_groups"] == 0
