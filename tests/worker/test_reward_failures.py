"""A reward that fails on every sample: counted in `loraflow status` and the progress line, and after
``worker.max_failed_reward_groups`` groups in a row a worker that says why, returns its leases and exits 2,
which the launcher's supervisor does not restart. Real broker and worker processes on loopback."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from loraflow.deploy import status
from loraflow.deploy.processes import Managed, RestartPolicy, Supervisor, Unrecoverable
from loraflow.deploy.progress import Progress, render
from tests.support import BrokerHandle, Processes, child_env, start_broker, wait_for

pytestmark = pytest.mark.slow

REWARD = "tests.worker.test_reward_failures:always_raises"


def always_raises(completion: str, answer: str, **info: Any) -> float:
    """A reward function whose service is down: every call raises."""
    raise RuntimeError("reward service unavailable")


def worker_argv(broker: BrokerHandle, worker_id: str, *overrides: str) -> list[str]:
    argv = [sys.executable, "-m", "loraflow.rollout_worker", "--endpoint", broker.endpoint, "--run-dir", str(broker.run_dir),
            "--worker-id", worker_id, "--backend", "sim", "--log-format", "json"]
    for override in (f'worker.reward="{REWARD}"', "worker.sim.tokens_per_s=5000", *overrides):
        argv += ["--set", override]
    return argv


def events(path: Path, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == name]


def test_every_sample_failing_stops_the_worker_with_exit_2_and_its_leases_back(procs: Processes,
                                                                               tmp_path: Path) -> None:
    broker = start_broker(procs, "run.group_size=2", "broker.lease_timeout_s=600")  # only a return frees a lease
    worker = procs.spawn("w1", worker_argv(broker, "w1", "worker.max_failed_reward_groups=3"), env=child_env())
    assert worker.wait(60) == 2, worker.log()[-3000:]
    (failing,) = events(worker.log_path, "reward_failing")
    assert REWARD in failing["error"] and "RuntimeError: reward service unavailable" in failing["error"]
    assert "3 groups in a row" in failing["error"] and "worker.max_failed_reward_groups" in failing["fix"]
    assert json.loads(worker.log().strip().splitlines()[-1])["event"] == "reward_failing"  # the last line
    assert len(events(worker.log_path, "group_submitted")) == 2  # the third group's lease went back instead
    # the return and the Bye come one after the other: a stats call may fall between them
    stats = wait_for(lambda: (s := broker.stats())["leases"]["outstanding"] == 0 and s["workers"] == [] and s, 5,
                     "the leases back and the worker gone")
    assert stats["prompts"]["queued"] >= 1

    # under `loraflow run`'s supervisor: exit 2 is not restarted, and the error shows the worker's reason
    supervisor = Supervisor(RestartPolicy(backoff_s=0.1))
    child = Managed(name="worker-0", argv=worker_argv(broker, "w2", "worker.max_failed_reward_groups=2"),
                    log_path=tmp_path / "worker-0.log", env=child_env())
    supervisor.add(child)
    try:
        with pytest.raises(Unrecoverable, match="reward_failing") as refused:
            wait_for(lambda: supervisor.check() and False, 60, "the supervisor to give up on the worker")
    finally:
        supervisor.kill_all()
    assert "exit code 2" in str(refused.value) and child.num_restarts == 0 and child.exit_codes == [2]


def test_failures_show_in_status_and_progress_and_0_never_stops(procs: Processes) -> None:
    broker = start_broker(procs, "run.group_size=2")
    worker = procs.spawn("w1", worker_argv(broker, "w1", "worker.max_failed_reward_groups=0"), env=child_env())
    wait_for(lambda: len(events(worker.log_path, "group_acked")) >= 5, 60, "5 groups that all failed", procs)
    row = wait_for(lambda: next((w for w in broker.stats()["workers"]
                                 if (w.get("counters") or {}).get("reward_failures", 0) >= 10), None),
                   10, "the failures in the worker's heartbeats")
    text = status.render(broker.stats())
    header = next(line for line in text.splitlines() if line.strip().startswith("ID"))
    line = next(line for line in text.splitlines() if line.strip().startswith("w1 "))
    column = header.split().index("REWARD-FAILED")
    assert int(line.split()[column]) >= row["counters"]["reward_failures"]
    progress = Progress(broker.run_dir, broker.endpoint)
    shown = render(progress.poll())
    assert f"reward failed {progress.snapshot.reward_failures}" in shown and progress.snapshot.reward_failures >= 10
    assert worker.alive() and not events(worker.log_path, "reward_failing")
    assert worker.stop() == 0
