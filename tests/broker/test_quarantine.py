"""Quarantine of worker processes whose rollouts fail the learner's policy check: the pure rule, table-driven,
then what the broker does with it on an in-process core (real encoded messages, explicit clock)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from loraflow.broker.quarantine import Quarantine, Status, Transition
from loraflow.common.protocol import BatchAck, BatchRequest, Kind, LeaseRequest, PolicyMismatch
from loraflow.deploy import status
from tests.broker.harness import LEARNER, W1, W2, Harness


def mismatch(group_id: str, worker_id: str = "", reason: str = "logprobs") -> PolicyMismatch:
    return PolicyMismatch(group_id=group_id, worker_id=worker_id, reason=reason, version=0, num_checked=12,
                          num_off=10, max_abs_diff=2.5, mean_abs_diff=1.25, detail="sample 1")


# -- the rule ------------------------------------------------------------------------------------------------

P, F = True, False  # a checked group passed / failed


@pytest.mark.parametrize("after, window, outcomes, statuses", [
    (2, 8, [F], ["ok"]),  # one failure does not quarantine
    (2, 8, [F, F], ["ok", "quarantined"]),  # two in the window do
    (2, 8, [F, P, P, F], ["ok", "ok", "ok", "quarantined"]),  # passes in between, still in the window
    (2, 3, [F, P, P, F], ["ok"] * 4),  # passes pushed the first failure out of a window of 3
    (2, 3, [F, P, F], ["ok", "ok", "quarantined"]),
    (1, 1, [P, F], ["ok", "quarantined"]),
    (3, 4, [F, F, P, P, F], ["ok"] * 5),
    (3, 4, [F, F, P, F], ["ok", "ok", "ok", "quarantined"]),
    (2, 8, [F, F, P, P, P], ["ok", "quarantined", "quarantined", "quarantined", "quarantined"]),  # passes do not
    # clear a quarantined process: only its restart, through probation
])
def test_failures_in_the_window_quarantine(after: int, window: int, outcomes: list[bool],
                                           statuses: list[str]) -> None:
    q = Quarantine(after=after, window=window)
    seen = []
    for i, passed in enumerate(outcomes):
        q.record(("w", "s1"), None if passed else mismatch(f"0:{i}"), now_s=float(i))
        seen.append(str(q.status(("w", "s1"))))
    assert seen == statuses


def test_processes_are_counted_apart() -> None:
    q = Quarantine(after=2, window=8)
    q.record(("w", "s1"), mismatch("0:0"), 0.0)
    q.record(("w", "s2"), mismatch("0:1"), 1.0)  # another process of the same client id
    q.record(("v", "s1"), mismatch("0:2"), 2.0)
    assert {q.status(k) for k in [("w", "s1"), ("w", "s2"), ("v", "s1")]} == {Status.OK}


@pytest.mark.parametrize("after_rejoin, transition, final", [
    ([P], Transition.CLEARED, "ok"),
    ([F], Transition.QUARANTINED, "quarantined"),  # one failure on probation is enough
])
def test_restart_is_on_probation(after_rejoin: list[bool], transition: Transition, final: str) -> None:
    q = Quarantine(after=2, window=8)
    for i in range(2):
        q.record(("w", "s1"), mismatch(f"0:{i}"), float(i))
    assert not q.rejoin("w", "s1", 5.0)  # a reconnect of the same process
    assert q.status(("w", "s1")) is Status.QUARANTINED
    assert not q.rejoin("v", "s9", 5.0)  # another client id
    assert q.rejoin("w", "s2", 6.0)
    assert q.status(("w", "s2")) is Status.PROBATION
    assert q.status(("w", "s1")) is Status.QUARANTINED  # the old process stays out if it comes back
    assert [r["worker"] for r in q.snapshot(7.0, 100.0)["quarantined"]] == []  # superseded: not shown
    probation, = q.snapshot(7.0, 100.0)["probation"]
    assert (probation["session"], probation["num_checked"], len(probation["evidence"])) == ("s2", 0, 2)
    assert q.record(("w", "s2"), None if after_rejoin[0] else mismatch("0:9"), 8.0) is transition
    assert str(q.status(("w", "s2"))) == final
    assert q.rejoin("w", "s3", 9.0) is (final == "quarantined")  # a cleared process's restart is free


def test_evidence_is_the_last_few_failures() -> None:
    q = Quarantine(after=1, window=8)
    for i in range(6):
        q.record(("w", "s1"), mismatch(f"0:{i}"), float(i))
    row, = q.snapshot(10.0, 1000.0)["quarantined"]
    assert [e["group_id"] for e in row["evidence"]] == ["0:2", "0:3", "0:4", "0:5"]
    assert row["evidence"][-1] == {
        "group_id": "0:5", "reason": "logprobs", "version": 0, "num_checked": 12, "num_off": 10,
        "max_abs_diff": 2.5, "mean_abs_diff": 1.25, "detail": "sample 1", "age_s": 5.0, "when_unix": 995.0}
    assert (row["num_failed"], row["num_checked"], row["since_s"]) == (6, 6, 10.0)


def test_records_are_bounded_healthy_ones_forgotten_first() -> None:
    q = Quarantine(after=1, window=2, max_tracked=3)
    q.record(("bad", "s"), mismatch("0:0"), 0.0)
    for i in range(5):
        q.record((f"ok{i}", "s"), None, float(i))
    assert q.status(("bad", "s")) is Status.QUARANTINED and len(q._records) == 3


def test_bad_bounds() -> None:
    with pytest.raises(ValueError, match="quarantine_after"):
        Quarantine(after=3, window=2)


# -- the broker ----------------------------------------------------------------------------------------------


@pytest.fixture
def h() -> Harness:
    harness = Harness("run.max_staleness=20", "broker.capacity_groups=64")  # admission never in the way
    for identity in (W1, W2, LEARNER):
        harness.hello(identity)
    return harness


def grant_of(h: Harness, identity: bytes, replies: list):
    grants = [r for i, r, _ in replies if i == identity and r.KIND == Kind.LEASE_GRANT]
    assert len(grants) == 1, replies
    return grants[0]


def serve(h: Harness, n: int):
    (_, batch, _), = h.send(LEARNER, BatchRequest(num_groups=n))
    return batch


def ack(h: Harness, batch, *, trained: list[str] = (), failed: list[PolicyMismatch] = ()):
    reply = h.reply_to(LEARNER, h.send(LEARNER, BatchAck(batch_id=batch.batch_id, step=1, trained_version=0,
                                                         group_ids=list(trained), mismatches=list(failed))))
    assert reply.KIND == Kind.ACK


def quarantine_w1(h: Harness) -> list:
    """W1 sends 0:0..0:3, holds the lease of 0:4; 0:0 and 0:1 fail the check (the learner copies a made-up
    worker_id: the broker's own record counts, not it)."""
    leases = h.lease(W1, 5)
    for lease in leases[:4]:
        assert h.submit(W1, lease).status == "accepted"
    batch = serve(h, 2)
    assert [e.group.group_id for e in batch.groups] == ["0:0", "0:1"]
    ack(h, batch, failed=[mismatch("0:0", worker_id="w2"), mismatch("0:1", worker_id="w2", reason="no_evidence")])
    return leases


def test_mismatches_quarantine_the_sender_and_take_back_what_it_holds(h: Harness) -> None:
    with capture_logs() as logs:
        leases = quarantine_w1(h)
    warning, = [e for e in logs if e["event"] == "worker_quarantined"]
    assert (warning["log_level"], warning["worker"], warning["session"]) == ("warning", "w1", "s1")
    assert (warning["dropped"], warning["leases_returned"], warning["num_failed"]) == (2, 1, 2)
    assert [(e["group_id"], e["reason"], e["num_off"], e["num_checked"], e["max_abs_diff"])
            for e in warning["evidence"]] == [("0:0", "logprobs", 10, 12, 2.5), ("0:1", "no_evidence", 10, 12, 2.5)]
    stats = h.stats()
    assert stats["dropped"] == {"policy_mismatch": 4}  # the two failed, the two it had buffered
    assert stats["lease_events"]["quarantined"] == 1 and stats["leases"]["outstanding"] == 0
    assert stats["prompts"]["queued"] == 5 and stats["buffer"]["groups"] == 0
    assert stats["prompts"]["trained_total"] == 0
    integrity = stats["integrity"]
    assert integrity["policy_mismatches"] == {"logprobs": 1, "no_evidence": 1}
    assert integrity["events"] == {"quarantined": 1} and integrity["probation"] == []
    assert (integrity["num_quarantined"], integrity["num_probation"]) == (1, 0)
    row, = integrity["quarantined"]
    assert (row["worker"], row["session"], row["status"], row["num_failed"]) == ("w1", "s1", "quarantined", 2)
    assert [(e["group_id"], e["reason"]) for e in row["evidence"]] == [("0:0", "logprobs"), ("0:1", "no_evidence")]
    assert {w["id"]: w["integrity"] for w in stats["workers"]} == {"w1": "quarantined", "w2": "ok"}

    grant = grant_of(h, W1, h.send(W1, LeaseRequest(max_leases=4, wait_ms=0)))
    assert (grant.leases, grant.reason) == ([], "quarantined")
    assert sorted(lease.group_id for lease in h.lease(W2, 5)) == ["0:0", "0:1", "0:2", "0:3", "0:4"]
    error = h.submit(W1, leases[4])  # the lease it held when quarantined: 0:4 is W2's now
    assert (error.KIND, error.code) == (Kind.ERROR, "quarantined") and "policy check" in error.message
    assert h.stats()["rejected"] == {"quarantined": 1} and h.stats()["leases"]["outstanding"] == 5


def test_a_refused_group_leaves_its_prompt_queued_once(h: Harness) -> None:
    leases = quarantine_w1(h)
    error = h.submit(W1, leases[4])  # its lease was taken back at the quarantine, nobody holds 0:4 yet
    assert error.code == "quarantined"
    stats = h.stats()
    assert stats["prompts"]["queued"] == 5 and stats["prompts"]["leased"] == 0 and stats["buffer"]["groups"] == 0
    assert sorted(lease.group_id for lease in h.lease(W2, 8)) == ["0:0", "0:1", "0:2", "0:3", "0:4", "0:5", "0:6",
                                                                   "0:7"]


def test_one_failure_re_queues_the_prompt_and_does_not_quarantine(h: Harness) -> None:
    lease, = h.lease(W1, 1)
    h.submit(W1, lease)
    ack(h, serve(h, 1), failed=[mismatch("0:0")])
    stats = h.stats()
    assert stats["dropped"] == {"policy_mismatch": 1} and stats["prompts"]["queued"] == 1
    assert stats["integrity"]["quarantined"] == [] and stats["workers"][0]["integrity"] == "ok"
    assert [lease.group_id for lease in h.lease(W1, 1)] == ["0:0"]


def test_a_quarantined_long_poll_is_answered_at_its_deadline(h: Harness) -> None:
    quarantine_w1(h)
    assert h.send(W1, LeaseRequest(max_leases=1, wait_ms=500)) == []  # no busy loop of empty grants
    grant = grant_of(h, W1, h.advance(0.6))
    assert (grant.leases, grant.reason) == ([], "quarantined")


def test_a_reconnect_stays_quarantined(h: Harness) -> None:
    quarantine_w1(h)
    h.hello(W1, session="s1")
    grant = grant_of(h, W1, h.send(W1, LeaseRequest(max_leases=1, wait_ms=0)))
    assert grant.reason == "quarantined" and h.stats()["integrity"]["probation"] == []


@pytest.mark.parametrize("passes", [True, False])
def test_a_restart_is_on_probation_with_one_lease(h: Harness, passes: bool) -> None:
    quarantine_w1(h)
    h.hello(W1, session="s2")
    integrity = h.stats()["integrity"]
    assert [r["session"] for r in integrity["probation"]] == ["s2"] and integrity["quarantined"] == []
    assert integrity["events"] == {"quarantined": 1, "probation": 1}
    lease, = h.lease(W1, 3)  # one at a time
    grant = grant_of(h, W1, h.send(W1, LeaseRequest(max_leases=3, wait_ms=0)))
    assert (grant.leases, grant.reason) == ([], "limit")
    assert h.submit(W1, lease).status == "accepted"
    batch = serve(h, 1)
    if passes:
        ack(h, batch, trained=[lease.group_id])
        assert len(h.lease(W1, 3)) == 3
        stats = h.stats()
        assert stats["integrity"]["probation"] == [] and stats["integrity"]["events"]["cleared"] == 1
        assert stats["prompts"]["trained_total"] == 1
    else:
        ack(h, batch, failed=[mismatch(lease.group_id)])  # one failure on probation: out again at once
        assert grant_of(h, W1, h.send(W1, LeaseRequest(max_leases=1, wait_ms=0))).reason == "quarantined"
        row, = h.stats()["integrity"]["quarantined"]
        assert (row["session"], row["num_quarantines"], len(row["evidence"])) == ("s2", 2, 3)
    assert h.hello(W1, session="s1") and grant_of(  # the first process, back: still out
        h, W1, h.send(W1, LeaseRequest(max_leases=1, wait_ms=0))).reason == "quarantined"


def test_quarantine_metrics_and_status(h: Harness) -> None:
    quarantine_w1(h)
    h.advance(1.5)  # a stats tick pushes counters and gauges
    text = h.core.stats.metrics.prometheus_text()
    assert 'loraflow_broker_quarantines_total{event="quarantined"} 1' in text
    assert 'loraflow_broker_policy_mismatches_total{reason="logprobs"} 1' in text
    assert 'loraflow_broker_dropped_total{reason="policy_mismatch"} 4' in text
    assert "loraflow_broker_quarantined_workers 1" in text and "loraflow_broker_probation_workers 0" in text
    lines = status.render(h.stats()).splitlines()
    assert "integrity mismatches logprobs 1  no_evidence 1  quarantined 1  probation 0" in lines
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["WORKER"])
    assert lines[header + 1].split() == ["w1", "s1", "quarantined", "2/2", "no_evidence", "v0", "10/12", "2.5",
                                         "1s", "ago"]


def test_status_without_integrity_checks() -> None:
    assert "integrity mismatches none  quarantined 0  probation 0" in status.render({})


def test_status_shows_the_learners_trusted_workers_and_audited_steps() -> None:
    learner = {"id": "learner", "state": "training", "step": 40,
               "counters": {"integrity_trusted": 2, "integrity_audited_steps": 3}}
    assert ("integrity mismatches none  quarantined 0  probation 0  learner trusts 2 worker process(es), audited 3 "
            "of 40 steps") in status.render({"learner": learner}).splitlines()


def test_a_batch_names_the_submitting_process_whatever_the_group_claims(h: Harness) -> None:
    """The learner's lora_id memory keys on (worker_id, worker_session): the broker fills the session from the
    Hello of the process that sent the group, so a worker cannot pose as a fresh process (or as another one)."""
    from tests.broker.clients import make_group

    first, second = h.lease(W1, 2)
    assert h.submit(W1, first).status == "accepted"
    record, tensors = make_group(second, "w2")  # poses as another worker ...
    record.worker_session = "made-up"  # ... and another process
    assert h.reply_to(W1, h.send(W1, record, tensors)).status == "accepted"
    batch = serve(h, 2)
    assert [(e.group.worker_id, e.group.worker_session) for e in batch.groups] == [("w1", "s1"), ("w1", "s1")]
