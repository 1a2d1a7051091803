"""`loraflow status`: the table rendering of a real snapshot, and the command against a running broker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.common.protocol import BatchRequest, Heartbeat
from loraflow.deploy import rundir, status
from tests.broker.harness import LEARNER, W1, W2, Harness
from tests.support import Processes, start_broker


def busy_snapshot() -> dict:
    h = Harness()
    h.hello(W1)
    h.hello(W2)
    h.hello(LEARNER)
    h.send(W1, Heartbeat(state="generating", adapter_version=0, counters={"reward_failures": 5}))
    for lease in h.lease(W1, 3):
        h.submit(W1, lease)
    h.send(LEARNER, BatchRequest(num_groups=2))
    h.publish(1)
    h.send(LEARNER, Heartbeat(state="training", adapter_version=1, counters={"busy_s": 3.0, "idle_s": 1.0}))
    return h.stats()


def test_render_shows_the_live_picture() -> None:
    text = status.render(busy_snapshot())
    lines = text.splitlines()
    assert lines[0].startswith("broker ") and "version 1" in lines[0] and "task arith" in lines[0]
    assert "queued 0  leased 0  buffered 1  training 2" in text
    assert "buffered 1:1  served 0:2" in text
    assert "learner   learner  training  v1" in text and "busy 75%" in text
    assert "workers   2" in text
    header = next(line for line in lines if line.strip().startswith("ID"))
    assert header.split() == ["ID", "STATE", "VERSION", "LEASES", "ACCEPTED", "REJECTED", "REWARD-FAILED", "BUSY",
                              "SEEN", "BACKEND", "HOST:PID"]
    w1 = next(line for line in lines if line.strip().startswith("w1 "))
    assert w1.split()[:7] == ["w1", "generating", "0", "0", "3", "0", "5"]
    w2 = next(line for line in lines if line.strip().startswith("w2 "))
    assert w2.split()[6] == "-"  # no counters reported yet
    assert "adapters  v1 (4.0 KB)" in text


def test_render_says_when_the_fleet_is_asked_to_beat_more_slowly() -> None:
    h = Harness("broker.max_heartbeats_per_second=1")
    assert "heartbeats every" not in status.render(h.stats())
    h.hello(W1)
    h.hello(W2)
    h.hello(LEARNER)
    h.advance(1.0)  # the liveness sweep sets the interval: 3 clients at 1 a second
    assert ("heartbeats every 3 s, not 1: the fleet is over the broker's budget of 1 a second; death after 15 s "
            "silent") in status.render(h.stats())


def test_render_tolerates_a_sparse_snapshot() -> None:
    text = status.render({})
    assert "learner   none connected" in text and "workers   0" in text


def test_status_command_once_and_json(procs: Processes, capsys: pytest.CaptureFixture) -> None:
    broker = start_broker(procs, "run.group_size=2", "run.groups_per_step=2")
    assert status.main(["--endpoint", broker.endpoint]) == 0
    assert capsys.readouterr().out.startswith(f"broker {broker.stats()['broker_id']}")
    assert status.main(["--set", f'broker.endpoint_file="{broker.endpoint_file}"', "--json"]) == 0
    snapshot = json.loads(capsys.readouterr().out)
    assert snapshot["settings"]["group_size"] == 2 and snapshot["workers"] == []
    broker.proc.stop()
    assert status.main(["--endpoint", broker.endpoint, "--timeout", "0.3"]) == 1
    assert "no stats from the broker" in capsys.readouterr().err


def test_with_no_broker_the_status_of_an_ended_run_says_how_it_ended(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """`loraflow status runs/<name>/config.toml` after the run: exit 1 (nothing listens), and the summary."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    endpoint = "tcp://127.0.0.1:9"  # nothing listens there
    argv = ["--endpoint", endpoint, "--timeout", "0.2", "--set", f'run.run_dir="{run_dir}"']
    assert status.main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("loraflow status: no stats")  # no summary yet
    rundir.summary_path(run_dir).write_text(json.dumps({
        "stop_reason": "eval.target_accuracy (90%) reached: 94.0% at v30", "error": "", "base_accuracy": 0.29,
        "final_accuracy": 0.885, "final_version": 35, "final_adapter": str(run_dir / "final_adapter"), "steps": 35,
        "wall_s": 281.5, "restarts": {"worker-1": 1}}))
    assert status.main(argv) == 1
    err = capsys.readouterr().err
    assert "no stats from the broker" in err
    assert f"the run in {run_dir} has ended" in err and "eval.target_accuracy (90%) reached: 94.0% at v30" in err
    assert "steps 35  final version v35  base accuracy 29.0%  final accuracy 88.5%  wall 4m41s" in err
    assert "restarts worker-1 1" in err and f"final adapter {run_dir / 'final_adapter'}" in err
    rundir.summary_path(run_dir).write_text(json.dumps({"stop_reason": "done", "wall_s": "long", "restarts": [1],
                                                        "final_accuracy": True}))  # fields of unexpected types
    assert status.main(argv) == 1
    err = capsys.readouterr().err
    assert "has ended" in err and "final accuracy -  wall 0s  restarts none" in err
    rundir.summary_path(run_dir).write_text("{ half written")  # a run writing it: the plain message, no traceback
    assert status.main(argv) == 1
    assert "has ended" not in capsys.readouterr().err
