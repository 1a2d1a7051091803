"""The broker's message semantics, exactly, on an in-process core (real encoded messages, explicit clock)."""

from __future__ import annotations

import numpy as np
import pytest

from loraflow.common import framing
from loraflow.common.codec import encode
from loraflow.common.protocol import (
    AdapterFetch,
    BatchAck,
    BatchRequest,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Kind,
    LeaseRequest,
    LeaseReturn,
    Welcome,
)
from tests.broker.clients import adapter_tensors, make_adapter, make_group
from tests.broker.harness import LEARNER, W1, W2, Harness


def kinds(replies: list, identity: bytes | None = None) -> list[str]:
    return [r.KIND.name for i, r, _ in replies if identity is None or i == identity]


@pytest.fixture
def h() -> Harness:
    harness = Harness()
    harness.hello(W1)
    harness.hello(LEARNER)
    return harness


# -- registration and roles ----------------------------------------------------------------------------------


@pytest.mark.parametrize("identity, record, code", [
    (b"worker/nobody", LeaseRequest(), "not_registered"),
    (W1, BatchRequest(num_groups=1), "forbidden"),
    (W1, BatchAck(batch_id="x", step=1, trained_version=0), "forbidden"),
    (LEARNER, LeaseRequest(), "forbidden"),
    (LEARNER, LeaseReturn(lease_ids=["x"]), "forbidden"),
    (W1, Welcome(broker_id="b", latest_version=0, group_size=1, groups_per_step=1, max_staleness=0,
                 heartbeat_interval_s=1, heartbeat_timeout_s=1, lease_timeout_s=1, max_message_bytes=1 << 20),
     "forbidden"),
])
def test_who_may_send_what(h: Harness, identity: bytes, record: object, code: str) -> None:
    replies = h.send(identity, record)
    assert [(r.KIND, r.code) for _, r, _ in replies] == [(Kind.ERROR, code)]
    assert h.stats()["rejected"] == {code: 1}


def test_worker_may_not_publish(h: Harness) -> None:
    error = h.publish(1, identity=W1)
    assert error.code == "forbidden" and h.core.latest_version == 0


def test_errors_sent_to_the_broker_are_counted_not_answered(h: Harness) -> None:
    assert h.send(W1, Error(code="internal", message="x")) == []
    assert h.stats()["rejected"] == {"forbidden": 1}


def test_heartbeat_pong_and_state(h: Harness) -> None:
    replies = h.send(W1, Heartbeat(adapter_version=0, state="generating", counters={"tokens": 5}))
    assert kinds(replies) == ["HEARTBEAT"]
    worker = h.stats()["workers"][0]
    assert worker["state"] == "generating" and worker["counters"] == {"tokens": 5}


def test_welcome_carries_the_run(h: Harness) -> None:
    (identity, welcome, _), = h.hello(W2)
    assert identity == W2 and welcome.group_size == 2 and welcome.vocab_size == 200
    assert welcome.heartbeat_timeout_s == 5 and welcome.broker_id == h.core.broker_id


def test_new_session_reclaims_leases_same_session_keeps_them(h: Harness) -> None:
    leases = h.lease(W1, 2)
    h.hello(W1, session="s1")
    assert h.stats()["leases"]["outstanding"] == 2
    h.hello(W1, session="s2")
    assert h.stats()["leases"]["outstanding"] == 0
    assert [lease.group_id for lease in h.lease(W1, 2)] == [lease.group_id for lease in leases]


def test_dead_worker_loses_leases_and_waiters(h: Harness) -> None:
    h.lease(W1, 4)
    assert h.send(W1, LeaseRequest(max_leases=1, wait_ms=60_000)) == []  # parked: no capacity left
    h.advance(5.6)  # silent for more than 5 misses x 1 s: both clients are dead
    stats = h.stats()
    assert stats["workers"] == [] and stats["learner"] is None and stats["leases"]["outstanding"] == 0
    assert stats["peers_gone"] == {"dead": 2} and stats["waiting"]["lease_requests"] == 0
    assert stats["prompts"]["queued"] == 4


def test_bye_returns_leases(h: Harness) -> None:
    h.lease(W1, 2)
    h.send(W1, Bye(reason="done"))
    assert h.stats()["prompts"]["queued"] == 2 and h.stats()["workers"] == []


# -- leases and groups ---------------------------------------------------------------------------------------


def test_lease_submit_ack_duplicate(h: Harness) -> None:
    lease, = h.lease(W1)
    assert (lease.group_id, lease.group_size, lease.task) == ("0:0", 2, "arith")
    assert lease.prompt.endswith("=")
    ack = h.submit(W1, lease)
    assert (ack.KIND, ack.status, ack.ref_id) == (Kind.ACK, "accepted", "0:0")
    again = h.submit(W1, lease)
    assert (again.KIND, again.status) == (Kind.ACK, "duplicate")
    stats = h.stats()
    assert stats["group_events"] == {"accepted": 1, "duplicate": 1}
    assert stats["buffer"]["groups"] == 1 and stats["prompts"]["buffered"] == 1


def test_batched_acks_one_per_pass_and_status(h: Harness) -> None:
    h.send(W2, Hello(role="worker", client_id="w2", session="s1", batched_acks=True))
    leases, other = h.lease(W2, 3), h.lease(W1)[0]
    for lease in [*leases, leases[0]]:  # three groups and a duplicate of the first, in one loop pass
        record, tensors = make_group(lease, "w2")
        h.core.handle(W2, encode(record, tensors), h.now)
    invalid, tensors = make_group(other, "w1", logprob=float("nan"))
    h.core.handle(W1, encode(invalid, tensors), h.now)
    replies = [(i, r) for i, r, _ in h.flush() if r.KIND in (Kind.ACK, Kind.ERROR)]
    assert [(i, r.status, r.ids) for i, r in replies if r.KIND == Kind.ACK] == [
        (W2, "accepted", ["0:0", "0:1", "0:2"]), (W2, "duplicate", ["0:0"])]
    assert [(i, r.code, r.ref_id) for i, r in replies if r.KIND == Kind.ERROR] == [(W1, "invalid_group", "0:3")]
    # a client that did not ask for them gets one Ack per group, without ref_ids
    ack = h.submit(W1, h.lease(W1)[0])
    assert (ack.ref_id, ack.ref_ids, ack.ids) == ("0:3", None, ["0:3"])  # 0:3 was re-queued
    many = [f"1:{i}" for i in range(5000)]  # more than one Ack may carry (ref_id + MAX_BATCH_GROUPS ref_ids)
    h.core.outbox.group_acks[(W2, "duplicate")] = list(many)
    acks = [r for _, r, _ in h.flush()]
    assert [len(a.ids) for a in acks] == [4097, 903] and [i for a in acks for i in a.ids] == many


@pytest.mark.parametrize("tensor_changes, message", [
    ({"logprob": float("nan")}, "NaN"),
    ({"logprob": 0.5}, "logprobs must be <= 0"),
    ({"vocab": 1000}, "ids outside"),
])
def test_invalid_group_is_refused_and_requeued(h: Harness, tensor_changes: dict, message: str) -> None:
    lease, = h.lease(W1)
    error = h.submit(W1, lease, **tensor_changes)
    assert (error.KIND, error.code, error.ref_id) == (Kind.ERROR, "invalid_group", "0:0")
    assert message in error.message
    assert h.stats()["prompts"]["queued"] == 1 and h.stats()["leases"]["outstanding"] == 0
    assert h.lease(W1)[0].group_id == "0:0"


def test_group_from_a_version_not_yet_published_is_invalid(h: Harness) -> None:
    lease, = h.lease(W1)
    error = h.submit(W1, lease, version=3)
    assert error.code == "invalid_group" and "newer than the latest" in error.message


def test_group_size_must_match(h: Harness) -> None:
    lease, = h.lease(W1)
    lease.group_size = 3
    error = h.submit(W1, lease)
    assert error.code == "invalid_group" and "group_size is 2" in error.message


@pytest.mark.parametrize("group_id", ["0:57", "7", "x:y"])
def test_group_for_a_prompt_never_leased(h: Harness, group_id: str) -> None:
    lease, = h.lease(W1)
    lease.group_id = group_id
    error = h.submit(W1, lease)
    assert error.code == "unknown_lease" and error.ref_id == group_id


def test_expired_lease_group_still_accepted_newer_lease_cancelled() -> None:
    h = Harness("broker.lease_timeout_s=2", "broker.heartbeat_interval_s=10")
    h.hello(W1)
    h.hello(W2)
    old, = h.lease(W1)
    h.advance(2.5)
    assert h.stats()["lease_events"] == {"granted": 1, "expired": 1}
    new, = h.lease(W2)
    assert new.group_id == old.group_id and new.lease_id != old.lease_id
    assert h.submit(W1, old).status == "accepted"
    assert h.stats()["lease_events"]["cancelled"] == 1
    assert h.submit(W2, new).status == "duplicate"


def test_lease_return(h: Harness) -> None:
    a, b = h.lease(W1, 2)
    assert h.send(W1, LeaseReturn(lease_ids=[a.lease_id])) == []
    error = h.reply_to(W1, h.send(W1, LeaseReturn(lease_ids=[a.lease_id, "bogus"])))
    assert error.code == "unknown_lease" and error.ref_id == a.lease_id
    assert h.stats()["prompts"]["queued"] == 1 and h.stats()["lease_events"]["returned"] == 1


def test_byte_bound_refuses_and_requeues() -> None:
    h = Harness("broker.max_buffer_bytes=65536", "broker.capacity_groups=8")
    h.hello(W1)
    first, second = h.lease(W1, 2)
    assert h.submit(W1, first, completion_len=3000).status == "accepted"  # ~80 KB: fits the empty buffer
    error = h.submit(W1, second, completion_len=10)
    assert error.code == "limit" and "max_buffer_bytes" in error.message
    stats = h.stats()
    assert stats["dropped"] == {"buffer_full": 1} and stats["prompts"]["queued"] == 1
    assert h.lease(W1, 4) == [] and stats["credit"] == 0  # the byte projection stops further leases


def test_backpressure_and_long_poll(h: Harness) -> None:
    leases = h.lease(W1, 10)
    assert len(leases) == 4  # capacity = groups_per_step x (max_staleness + 1)
    assert h.send(W1, LeaseRequest(max_leases=2, wait_ms=3000)) == []
    assert h.stats()["waiting"]["lease_requests"] == 1
    for lease in leases:
        h.submit(W1, lease)
    (_, batch, _), = h.send(LEARNER, BatchRequest(num_groups=2))
    assert [e.group.group_id for e in batch.groups] == ["0:0", "0:1"]
    replies = h.send(LEARNER, BatchAck(batch_id=batch.batch_id, step=1, trained_version=0,
                                       group_ids=["0:0", "0:1"]))
    # two slots are free, but the admission limit ((1 + 1 + 0 versions) x 2 - 2 trained) waits for version 1
    assert kinds(replies) == ["ACK"] and h.stats()["credit"] == 0
    record, tensors = make_adapter(1)
    replies = h.send(LEARNER, record, tensors)
    grants = [r for i, r, _ in replies if r.KIND == Kind.LEASE_GRANT]
    # W1 still holds v0: its groups would queue behind 0:2 and 0:3 and be trained at v2, past the bound,
    # so it is told to fetch v1 instead of being given work that would be dropped as stale
    assert grants[0].leases == [] and grants[0].reason == "stale_adapter"
    assert h.stats()["waiting"]["lease_requests"] == 0
    assert [lease.group_id for lease in h.lease(W1, 2, adapter_version=1)] == ["0:4", "0:5"]


def test_long_poll_times_out_with_reason(h: Harness) -> None:
    h.lease(W1, 4)
    assert h.send(W1, LeaseRequest(max_leases=1, wait_ms=1000)) == []
    (identity, grant, _), = h.advance(1.01)
    assert identity == W1 and grant.leases == [] and grant.reason == "backpressure"


def test_stale_adapter_is_answered_at_once(h: Harness) -> None:
    h.publish(1)
    h.publish(2)
    replies = h.send(W1, LeaseRequest(max_leases=1, adapter_version=0, wait_ms=5000))
    assert [(r.leases, r.reason) for _, r, _ in replies] == [([], "stale_adapter")]


# -- batches -------------------------------------------------------------------------------------------------


def fill(h: Harness, n: int, version: int = 0) -> list:
    leases = h.lease(W1, n, adapter_version=version)
    for lease in leases:
        assert h.submit(W1, lease, version=version).status == "accepted"
    return leases


def test_batch_long_poll_is_served_when_groups_arrive(h: Harness) -> None:
    assert h.send(LEARNER, BatchRequest(num_groups=2, wait_ms=5000)) == []
    leases = h.lease(W1, 2)
    h.submit(W1, leases[0])
    record, tensors = make_group(leases[1], "w1")
    replies = h.send(W1, record, tensors)
    batch = [(r, e) for i, r, e in replies if r.KIND == Kind.BATCH]
    assert len(batch) == 1
    record, envelope = batch[0]
    assert [e.group.group_id for e in record.groups] == ["0:0", "0:1"]
    spec = envelope.specs[6]
    assert spec.name == "completion_ids"
    assert np.array_equal(framing.as_numpy(spec, envelope.frames[spec.frame]), tensors[1][1])


def test_empty_batch_after_wait(h: Harness) -> None:
    fill(h, 1)
    assert h.send(LEARNER, BatchRequest(num_groups=2, wait_ms=500)) == []
    (_, batch, _), = h.advance(0.6)
    assert batch.groups == [] and batch.batch_id == ""


def test_request_larger_than_capacity_is_refused(h: Harness) -> None:
    error = h.reply_to(LEARNER, h.send(LEARNER, BatchRequest(num_groups=5)))
    assert error.code == "limit" and "capacity_groups" in error.message


def test_ack_with_unlisted_groups_requeues_them(h: Harness) -> None:
    fill(h, 2)
    (_, batch, _), = h.send(LEARNER, BatchRequest(num_groups=2))
    ack = h.reply_to(LEARNER, h.send(LEARNER, BatchAck(batch_id=batch.batch_id, step=1, trained_version=0,
                                                       group_ids=["0:1"])))
    assert (ack.ref_kind, ack.ref_id) == (Kind.BATCH_ACK, batch.batch_id)
    stats = h.stats()
    assert stats["dropped"] == {"not_trained": 1} and stats["prompts"]["queued"] == 1
    assert stats["prompts"]["trained_total"] == 1 and stats["buffer"]["training_groups"] == 0


def test_unknown_batch_ack(h: Harness) -> None:
    error = h.reply_to(LEARNER, h.send(LEARNER, BatchAck(batch_id="gone", step=1, trained_version=0)))
    assert error.code == "unknown_batch"
    leases = fill(h, 1) + h.lease(W1, 1)  # 0:0 buffered, 0:1 leased
    ack = h.reply_to(LEARNER, h.send(LEARNER, BatchAck(batch_id="gone", step=1, trained_version=0,
                                                       group_ids=["0:0", "0:1", "0:99"])))
    assert ack.KIND == Kind.ACK
    stats = h.stats()
    assert stats["prompts"]["trained_total"] == 2 and stats["buffer"]["groups"] == 0
    assert stats["leases"]["outstanding"] == 0
    assert h.submit(W1, leases[1]).status == "duplicate"


def test_stale_groups_dropped_and_requeued(h: Harness) -> None:
    fill(h, 2)
    h.publish(1)
    h.publish(2)  # groups of version 0 are 2 behind, the bound is 1
    assert h.send(LEARNER, BatchRequest(num_groups=2, wait_ms=1000)) == []
    stats = h.stats()
    assert stats["dropped"] == {"stale": 2} and stats["prompts"]["queued"] == 2
    assert [lease.group_id for lease in h.lease(W1, 2, adapter_version=2)] == ["0:0", "0:1"]


def test_stale_on_arrival(h: Harness) -> None:
    lease, = h.lease(W1)
    h.publish(1)
    h.publish(2)
    error = h.submit(W1, lease, version=0)
    assert error.code == "invalid_group" and "max_staleness" in error.message
    assert h.stats()["dropped"] == {"stale_on_arrival": 1} and h.stats()["rejected"] == {"stale": 1}


def test_learner_death_restores_its_batches(h: Harness) -> None:
    fill(h, 4)
    h.send(LEARNER, BatchRequest(num_groups=2))
    h.send(LEARNER, BatchRequest(num_groups=2))
    assert h.stats()["buffer"]["training_groups"] == 4
    h.hello(LEARNER, session="restarted")
    stats = h.stats()
    assert stats["buffer"]["groups"] == 4 and stats["group_events"]["restored"] == 4
    (_, batch, _), = h.send(LEARNER, BatchRequest(num_groups=4))
    assert [e.group.group_id for e in batch.groups] == ["0:0", "0:1", "0:2", "0:3"]


@pytest.mark.parametrize("new_identity", [b"learner/learner/route2", b"learner/other"])
def test_a_second_learner_replaces_the_first_which_is_fenced(h: Harness, new_identity: bytes) -> None:
    fill(h, 2)
    h.send(LEARNER, BatchRequest(num_groups=2))  # the first learner holds a batch in training
    replies = h.send(new_identity, Hello(role="learner", client_id=new_identity.decode().split("/")[1],
                                         session="second", host="node-2", pid=4242))
    told = [r for i, r, _ in replies if i == LEARNER]
    assert [(r.KIND, r.code) for r in told] == [(Kind.ERROR, "replaced")], replies
    assert "node-2" in told[0].message and "pid 4242" in told[0].message
    assert kinds(replies, new_identity) == ["WELCOME"]
    # whatever the fenced learner sends from now on, a reconnecting Hello included, is refused and counted
    for record in (BatchAck(batch_id="b", step=1, trained_version=0, group_ids=["0:0"]),
                   BatchRequest(num_groups=2), Heartbeat(),
                   Hello(role="learner", client_id="learner", session="s1")):
        replies = h.send(LEARNER, record)
        assert [(i, r.code) for i, r, _ in replies] == [(LEARNER, "replaced")], replies
    stats = h.stats()
    assert stats["rejected"]["replaced"] == 5 and stats["learner"]["session"] == "second"
    # the successor gets the groups the fenced one had in training
    (_, batch, _), = h.send(new_identity, BatchRequest(num_groups=2))
    assert [e.group.group_id for e in batch.groups] == ["0:0", "0:1"]


def test_groups_that_aged_in_training_are_dropped_when_restored(h: Harness) -> None:
    fill(h, 2)
    h.send(LEARNER, BatchRequest(num_groups=2))
    h.publish(1)
    h.publish(2)  # the training groups (version 0) are now 2 behind, the bound is 1
    h.hello(LEARNER, session="restarted")  # its batch comes back to the buffer
    assert h.send(LEARNER, BatchRequest(num_groups=2, wait_ms=1000)) == []
    stats = h.stats()
    assert stats["dropped"] == {"stale": 2} and stats["prompts"]["queued"] == 2


def test_undeliverable_batch_and_grant_are_taken_back(h: Harness) -> None:
    fill(h, 2)
    h.failing = {LEARNER, W1}
    assert h.send(LEARNER, BatchRequest(num_groups=2)) == []
    assert h.lease(W1, 2) == []
    stats = h.stats()
    assert stats["buffer"]["groups"] == 2 and stats["buffer"]["training_groups"] == 0
    assert stats["send_failed"] == {"unreachable": 2} and stats["lease_events"]["undeliverable"] == 2
    assert stats["prompts"]["queued"] == 2


# -- adapters ------------------------------------------------------------------------------------------------


def test_publish_notice_fetch_and_late_joiner(h: Harness) -> None:
    h.hello(W2)
    tensors = adapter_tensors(seed=1)
    replies = h.send(LEARNER, *make_adapter(1, tensors))
    assert sorted(kinds(replies)) == ["ACK", "ADAPTER_NOTICE", "ADAPTER_NOTICE"]
    (_, update, envelope), = h.send(W1, AdapterFetch(version=0))
    assert update.version == 1
    assert np.array_equal(np.frombuffer(envelope.frames[0], dtype=np.float32), tensors[0][1])
    replies = h.hello(b"worker/late", adapter_version=0)
    assert kinds(replies) == ["WELCOME", "ADAPTER_NOTICE"] and replies[1][1].version == 1  # a notice, no tensors
    (_, update, _), = h.send(b"worker/late", AdapterFetch(version=0))
    assert update.version == 1
    assert kinds(h.hello(b"worker/current", adapter_version=1)) == ["WELCOME"]


@pytest.mark.parametrize("version, code", [(1, "stale_version"), (0, "malformed")])
def test_publish_must_advance(h: Harness, version: int, code: str) -> None:
    h.publish(1)
    error = h.publish(version)
    assert error.code == code
    # the version it refused travels as an int (ref_version), and as text in ref_id for older readers
    if code == "stale_version":
        assert (error.ref_version, error.ref_id) == (1, "1")


def test_publish_checks_sha256(h: Harness) -> None:
    record, tensors = make_adapter(1)
    record.sha256 = "0" * 64
    error = h.reply_to(LEARNER, h.send(LEARNER, record, tensors))
    assert error.code == "malformed" and "sha256" in error.message and h.core.latest_version == 0


def test_only_newest_adapters_are_kept() -> None:
    h = Harness("broker.num_adapters_kept=2")
    h.hello(W1)
    h.hello(LEARNER)
    for version in (1, 2, 3):
        h.publish(version)
    assert [a["version"] for a in h.stats()["adapters"]] == [2, 3]
    error = h.reply_to(W1, h.send(W1, AdapterFetch(version=1)))
    assert error.code == "stale_version" and "kept: [2, 3]" in error.message and error.ref_version == 1
    (_, update, _), = h.send(W1, AdapterFetch(version=2))
    assert update.version == 2


def test_fetch_before_any_publish(h: Harness) -> None:
    error = h.reply_to(W1, h.send(W1, AdapterFetch()))
    assert error.code == "stale_version" and "none published yet" in error.message


def test_restart_restores_cursor_pending_and_adapter(tmp_path) -> None:
    h = Harness(state_path=tmp_path / "state.json")
    h.hello(W1)
    h.hello(LEARNER)
    leases = fill(h, 2) + h.lease(W1, 1)  # 0:0, 0:1 buffered; 0:2 leased
    (_, batch, _), = h.send(LEARNER, BatchRequest(num_groups=2))
    h.send(LEARNER, BatchAck(batch_id=batch.batch_id, step=1, trained_version=0, group_ids=["0:0"]))
    h.publish(1)
    h.restart()
    assert h.core.latest_version == 1 and h.core.ledger.state((0, 0)) == "trained"
    assert h.core.ledger.snapshot()["queued"] >= 2  # 0:1 (not trained) and 0:2 (leased), plus the reserved block
    replies = h.hello(W2, adapter_version=0)
    assert kinds(replies) == ["WELCOME", "ADAPTER_NOTICE"] and replies[1][1].version == 1
    h.hello(W1, session="s2")
    assert [lease.group_id for lease in h.lease(W1, 3, adapter_version=1)] == ["0:1", "0:2", "0:3"]
    assert h.submit(W1, leases[0], version=1).status == "duplicate"


def test_parked_request_of_a_worker_left_behind_is_answered_at_publish(h: Harness) -> None:
    h.lease(W1, 4)
    assert h.send(W1, LeaseRequest(max_leases=1, adapter_version=0, wait_ms=60_000)) == []
    h.publish(1)
    assert h.stats()["waiting"]["lease_requests"] == 1  # one version behind is within max_staleness 1
    replies = h.send(LEARNER, *make_adapter(2))
    grants = [r for i, r, _ in replies if i == W1 and r.KIND == Kind.LEASE_GRANT]
    assert [(g.leases, g.reason) for g in grants] == [([], "stale_adapter")]
    assert h.stats()["waiting"]["lease_requests"] == 0


def test_many_parked_requests_are_served_in_order_as_credit_frees(h: Harness) -> None:
    workers = [f"worker/p{i}".encode() for i in range(6)]
    for identity in workers:
        h.hello(identity)
    h.send(LEARNER, *make_adapter(1))  # the admission limit is now (1 + 1 + 1) x 2: capacity 4 binds
    fill(h, 4, version=1)  # capacity 4 is now all buffered
    for identity in workers:
        assert h.send(identity, LeaseRequest(max_leases=1, adapter_version=1, wait_ms=60_000)) == []
    (_, batch, _), = h.send(LEARNER, BatchRequest(num_groups=2))
    replies = h.send(LEARNER, BatchAck(batch_id=batch.batch_id, step=1, trained_version=1,
                                       group_ids=["0:0", "0:1"]))  # frees 2 slots
    granted = [i for i, r, _ in replies if r.KIND == Kind.LEASE_GRANT]
    assert granted == workers[:2] and h.stats()["waiting"]["lease_requests"] == 4
