"""The quarantine across a broker restart: the state file's ``quarantine`` field (round trip, a file written
before it existed, corrupt entries, the cap), an in-process core restarted on its state file, and a real broker
process SIGKILLed and restarted while a worker it quarantined stays connected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from loraflow.broker.quarantine import MAX_PERSISTED, Quarantine, Status
from loraflow.broker.state import EvidenceEntry, QuarantineEntry, QuarantineState, load_state, save_state
from loraflow.common.protocol import BatchAck, BatchRequest, Kind, LeaseRequest, PolicyMismatch
from loraflow.common.schema import dump
from loraflow.deploy import status
from tests.broker.clients import Learner, Worker
from tests.broker.harness import LEARNER, W1, W2, Harness
from tests.broker.test_quarantine import grant_of, mismatch, quarantine_w1
from tests.broker.test_state import state
from tests.support import Processes, start_broker, wait_for

EVIDENCE = EvidenceEntry(group_id="0:3", reason="logprobs", version=2, num_checked=12, num_off=10,
                         max_abs_diff=2.5, mean_abs_diff=1.25, detail="sample 1", when_unix=1.8e9)


def entry(**changes) -> QuarantineEntry:
    fields = dict(worker="w1", session="s1", status="quarantined", since_unix=1.8e9, num_failed=2, num_checked=3,
                  num_quarantines=1, evidence=[EVIDENCE])
    return QuarantineEntry(**{**fields, **changes})


# -- the state file ------------------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    flagged = QuarantineState(entries=[entry(), entry(session="s0", superseded=True, evidence=[]),
                                       entry(worker="w2", status="probation", num_failed=0, num_checked=0)],
                              num_left_out=3)
    save_state(path, state(quarantine=flagged))
    assert json.loads(path.read_text())["quarantine"]["entries"][0]["evidence"][0]["reason"] == "logprobs"
    assert load_state(path).quarantine == flagged


def test_a_file_written_before_the_field_loads_with_no_quarantine(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    save_state(path, state())
    old = json.loads(path.read_text())
    del old["quarantine"]
    path.write_text(json.dumps(old))
    loaded = load_state(path)
    assert loaded.quarantine == QuarantineState() and loaded.pending_keys() == [(0, 3), (0, 7)]


@pytest.mark.parametrize("change, match", [
    (dict(status="ok"), r"quarantine.entries\[0\].status: must be one of"),
    (dict(num_failed=4), r"quarantine.entries\[0\]: num_failed 4 > num_checked 3"),
    (dict(since_unix=-1.0), r"since_unix: must be >= 0"),
    (dict(session="s" * 129), r"session: at most 128"),
    (dict(evidence=[dump(EVIDENCE)] * 5), r"evidence: at most 4 items"),
    (dict(evidence=[{"group_id": "0:3", "reason": "bad", "when_unix": 1.0}]), r"evidence\[0\].reason: must be one"),
    (dict(evidence=[{"group_id": "0:3", "reason": "logprobs"}]), r"evidence\[0\].when_unix: required field"),
    (dict(extra=1), r"entries\[0\]: unknown field"),
])
def test_a_corrupt_entry_is_refused_with_the_state_files_error(tmp_path: Path, change: dict, match: str) -> None:
    path = tmp_path / "state.json"
    save_state(path, state(quarantine=QuarantineState(entries=[entry()])))
    content = json.loads(path.read_text())
    content["quarantine"]["entries"][0].update(change)
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match) as info:
        load_state(path)
    assert str(info.value).startswith(f"{path}: not a valid broker state file") and "move it away" in str(info.value)


def test_too_many_entries_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    entries = [entry(session=f"s{i}") for i in range(MAX_PERSISTED + 1)]
    save_state(path, state(quarantine=QuarantineState(entries=entries)))
    with pytest.raises(ValueError, match=f"quarantine.entries: at most {MAX_PERSISTED}"):
        load_state(path)


def test_persisted_keeps_current_before_superseded_then_the_newest() -> None:
    q = Quarantine(after=1, window=4)
    for i, worker in enumerate(["a", "b", "c", "ok"]):
        q.record((worker, "s1"), None if worker == "ok" else mismatch(f"0:{i}"), float(i))
    assert q.rejoin("a", "s2", 10.0)  # a/s1 superseded, a/s2 on probation
    rows, left_out = q.persisted(limit=3)
    assert [key for key, _ in rows] == [("a", "s2"), ("c", "s1"), ("b", "s1")] and left_out == 1
    assert q.persisted()[1] == 0 and len(q.persisted()[0]) == 4  # the healthy one is never kept


# -- a core restarted on its state file ----------------------------------------------------------------------


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    harness = Harness("run.max_staleness=20", "broker.capacity_groups=64", state_path=tmp_path / "state.json")
    for identity in (W1, W2, LEARNER):
        harness.hello(identity)
    return harness


def restart(h: Harness, seconds: float = 30.0) -> None:
    """A crash, then the new core on another monotonic clock: the persisted times are wall clock."""
    h.now += seconds
    h.restart()
    for identity in (W2, LEARNER):
        h.hello(identity)


def test_a_quarantined_process_stays_out_after_a_broker_restart(h: Harness) -> None:
    leases = quarantine_w1(h)
    before = h.stats()["integrity"]["quarantined"]
    restart(h)
    h.hello(W1, session="s1")  # the same process reconnects
    assert grant_of(h, W1, h.send(W1, LeaseRequest(max_leases=2, wait_ms=0))).reason == "quarantined"
    error = h.submit(W1, leases[4])  # a group it generated before the restart: not buffered
    assert (error.KIND, error.code) == (Kind.ERROR, "quarantined")
    stats = h.stats()
    assert stats["buffer"]["groups"] == 0 and stats["integrity"]["probation"] == []
    after, = stats["integrity"]["quarantined"]
    for row in (before[0], after):  # times on their own clocks
        del row["since_s"]
        for evidence in row["evidence"]:
            del evidence["age_s"]
            evidence["when_unix"] = pytest.approx(evidence["when_unix"], abs=0.002)
    assert after == before[0]
    assert {w["id"]: w["integrity"] for w in stats["workers"]} == {"w1": "quarantined", "w2": "ok"}


@pytest.mark.parametrize("passes", [True, False])
def test_a_restarted_worker_rejoins_on_probation_after_a_broker_restart(h: Harness, passes: bool) -> None:
    quarantine_w1(h)
    restart(h)
    h.hello(W1, session="s2")  # a new process of w1
    integrity = h.stats()["integrity"]
    assert [r["session"] for r in integrity["probation"]] == ["s2"] and integrity["quarantined"] == []
    assert len(integrity["probation"][0]["evidence"]) == 2  # carried over from the quarantined process
    lease, = h.lease(W1, 3)  # one at a time
    assert h.submit(W1, lease).status == "accepted"
    (_, batch, _), = h.send(LEARNER, BatchRequest(num_groups=1))
    failed = [] if passes else [mismatch(lease.group_id)]
    h.send(LEARNER, BatchAck(batch_id=batch.batch_id, step=1, trained_version=0,
                             group_ids=[lease.group_id] if passes else [], mismatches=failed))
    assert str(h.core.quarantine.status(("w1", "s2"))) == ("ok" if passes else "quarantined")
    restart(h)  # again: the probation's outcome is what the next broker knows, and s1 is still out
    h.hello(W1, session="s1")
    assert grant_of(h, W1, h.send(W1, LeaseRequest(max_leases=1, wait_ms=0))).reason == "quarantined"
    assert h.core.quarantine.status(("w1", "s2")) is (Status.OK if passes else Status.QUARANTINED)


def test_a_process_on_probation_is_still_on_probation_after_a_broker_restart(h: Harness) -> None:
    quarantine_w1(h)
    h.hello(W1, session="s2")
    h.core.persist()  # the next write (any) carries the probation
    restart(h)
    h.hello(W1, session="s2")
    assert len(h.lease(W1, 3)) == 1


def test_flagged_processes_past_the_cap_are_counted_and_lost(h: Harness) -> None:
    for i in range(MAX_PERSISTED + 2):
        for j in range(2):
            h.core.quarantine.record((f"bad{i}", "s1"), mismatch(f"0:{j}"), h.now + i)
    h.core.persist()
    with capture_logs() as logs:
        restart(h)
    lost, = [e for e in logs if e["event"] == "quarantine_records_lost"]
    assert lost["num_left_out"] == 2
    assert h.core.quarantine.count(Status.QUARANTINED) == MAX_PERSISTED
    assert [h.core.quarantine.status((f"bad{i}", "s1")) for i in (0, 1, 2)] == [Status.OK, Status.OK,
                                                                                 Status.QUARANTINED]


# -- a real broker process -----------------------------------------------------------------------------------

FAST = ("broker.heartbeat_interval_s=0.2", "broker.heartbeat_misses=5", "run.group_size=2", "run.groups_per_step=2",
        "run.max_staleness=20", "broker.capacity_groups=8")


def test_sigkilled_broker_keeps_its_quarantine(procs: Processes, capsys: pytest.CaptureFixture) -> None:
    broker = start_broker(procs, *FAST)
    worker = Worker(broker.endpoint, "bad", session="bad-1")
    learner = Learner(broker.endpoint, token=broker.run_token)
    try:
        leases = worker.lease(3).leases
        for lease in leases:
            worker.submit(lease)
            assert worker.reply().status == "accepted"
        batch = learner.batch(2).record
        failed = [PolicyMismatch(group_id=e.group.group_id, reason="logprobs", num_checked=12, num_off=10,
                                 max_abs_diff=2.5, mean_abs_diff=1.25, detail="fabricated") for e in batch.groups]
        learner.link.send(BatchAck(batch_id=batch.batch_id, step=1, trained_version=0, mismatches=failed))
        assert learner.expect(Kind.ACK, Kind.ERROR).record.KIND == Kind.ACK  # sent after the state write
        assert [r["worker"] for r in broker.stats()["integrity"]["quarantined"]] == ["bad"]

        broker.proc.kill()  # SIGKILL: nothing written on the way out
        broker = start_broker(procs, *FAST, f'broker.bind="{broker.endpoint}"', run_dir=broker.run_dir,
                              name="broker2")
        worker.expect_reconnected()  # the same process (session bad-1) says Hello again
        grant = worker.lease(2)
        assert (grant.leases, grant.reason) == ([], "quarantined")
        worker.submit(leases[2])  # the group the old broker had buffered, re-sent: refused
        error = worker.reply()
        assert (error.KIND, error.code) == (Kind.ERROR, "quarantined")
        stats = broker.stats()
        assert stats["buffer"]["groups"] == 0 and stats["prompts"]["trained_total"] == 0
        row, = stats["integrity"]["quarantined"]
        assert (row["worker"], row["session"], row["num_failed"], row["num_quarantines"]) == ("bad", "bad-1", 2, 1)
        assert [(e["group_id"], e["detail"]) for e in row["evidence"]] == [(e.group.group_id, "fabricated")
                                                                            for e in batch.groups]
        assert status.main(["--endpoint", broker.endpoint]) == 0
        shown = capsys.readouterr().out
        assert "quarantined 1  probation 0" in shown
        assert any(line.split()[:3] == ["bad", "bad-1", "quarantined"] for line in shown.splitlines()), shown

        worker.close()  # a restart of the worker: a new process, on probation
        worker = Worker(broker.endpoint, "bad", session="bad-2")
        wait_for(lambda: [r["session"] for r in broker.stats()["integrity"]["probation"]] == ["bad-2"], 10,
                 "the new process to be on probation", procs)
        assert len(worker.lease(3).leases) == 1
    finally:
        worker.close()
        learner.close()
