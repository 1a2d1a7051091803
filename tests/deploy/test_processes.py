"""Supervision: crashed children restart with backoff, config errors and endless crashes are fatal, stops are
clean (SIGTERM, then SIGKILL), and every start and exit is recorded."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from loraflow.common.cli import one_host_torchrun
from loraflow.common.timeline import Timeline
from loraflow.deploy import rundir
from loraflow.deploy.processes import ConfigClassExit, Managed, RestartPolicy, Supervisor, Unrecoverable
from tests.support import child_env, wait_for

# a child that counts its starts in a file and exits with the code given for that start (default: runs on)
SCRIPT = """
import os, signal, sys, time
path, codes = sys.argv[1], [int(c) for c in sys.argv[2].split(",") if c]
n = len(open(path).read()) if os.path.exists(path) else 0
open(path, "a").write("x")
if sys.argv[3] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[3] == "count-term":  # a clean exit that takes a while; the exit code is the number of SIGTERMs seen
    terms = []
    signal.signal(signal.SIGTERM, lambda *_: terms.append(1))
    print("ready", flush=True)
    while not terms:
        time.sleep(0.01)
    time.sleep(0.5)
    sys.exit(len(terms))
print("start", n, flush=True)
if n < len(codes):
    sys.exit(codes[n])
while True:
    time.sleep(0.05)
"""


def child(tmp_path: Path, name: str, codes: str, mode: str = "") -> Managed:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    return Managed(name=name, argv=[sys.executable, str(script), str(tmp_path / f"{name}.starts"), codes, mode],
                   log_path=tmp_path / "logs" / f"{name}.log", env=dict(os.environ))


def starts(tmp_path: Path, name: str) -> int:
    path = tmp_path / f"{name}.starts"
    return len(path.read_text()) if path.exists() else 0


def run_until(supervisor: Supervisor, condition, timeout_s: float = 20.0) -> list[Managed]:
    finished: list[Managed] = []

    def step():
        finished.extend(supervisor.check())
        return condition()

    wait_for(step, timeout_s, "the supervised condition")
    return finished


def test_a_crashing_child_is_restarted_with_backoff(tmp_path: Path) -> None:
    events: list[str] = []
    supervisor = Supervisor(RestartPolicy(backoff_s=0.2, max_backoff_s=0.3, max_restarts=3), on_event=events.append,
                            events_path=tmp_path / "processes.jsonl")
    worker = supervisor.add(child(tmp_path, "worker-1", "1,-9"))  # exit 1, then exit -9... then runs
    began = time.monotonic()
    # the third start counted (the file is written before the log line) and its log line written
    run_until(supervisor, lambda: starts(tmp_path, "worker-1") == 3 and worker.alive()
              and "start 2" in worker.log_path.read_text())
    assert time.monotonic() - began >= 0.2 + 0.3  # backoff 0.2 s, then doubled and capped at 0.3 s
    assert worker.num_restarts == 2 and worker.exit_codes == [1, 247]
    assert len(events) == 2 and "restarting in" in events[0]
    supervisor.stop(["worker-1"], timeout_s=5)
    assert not worker.alive() and worker.exit_codes[-1] == -signal.SIGTERM
    recorded = [(e["process"], e["event"]) for e in rundir.read_jsonl(tmp_path / "processes.jsonl")]
    assert recorded == [("worker-1", "start"), ("worker-1", "exit")] * 3
    assert worker.log_path.read_text().count("start ") == 3  # the log is appended across restarts


def test_exit_zero_is_finished_not_restarted(tmp_path: Path) -> None:
    supervisor = Supervisor(RestartPolicy(backoff_s=0.05))
    learner = supervisor.add(child(tmp_path, "learner", "0"))
    finished = run_until(supervisor, lambda: learner.finished)
    assert finished == [learner] and learner.num_restarts == 0
    assert supervisor.check() == []


@pytest.mark.parametrize("name, code, message", [
    ("broker", "2", "broker refused to start .*exit code 2.*start 0"),  # a usage or config error
    ("learner", "4", "learner was replaced by another learner process .*exit code 4.*start 0"),  # fenced
])
def test_a_config_error_or_a_fenced_learner_is_fatal_at_once(tmp_path: Path, name: str, code: str,
                                                             message: str) -> None:
    supervisor = Supervisor(RestartPolicy(backoff_s=0.05))
    supervisor.add(child(tmp_path, name, code))
    with pytest.raises(Unrecoverable, match=f"(?s){message}"):
        run_until(supervisor, lambda: False)
    assert starts(tmp_path, name) == 1


def test_endless_crashes_give_up_naming_the_setting(tmp_path: Path) -> None:
    supervisor = Supervisor(RestartPolicy(backoff_s=0.01, max_backoff_s=0.02, max_restarts=2))
    supervisor.add(child(tmp_path, "worker-2", "3,3,3,3,3"))
    with pytest.raises(Unrecoverable, match=r"(?s)worker-2 failed 3 times in a row \(last: exit code 3\).*max_restarts = 2"):
        run_until(supervisor, lambda: False)
    assert starts(tmp_path, "worker-2") == 3


def test_a_child_gets_one_sigterm_however_often_it_is_asked_to_stop(tmp_path: Path) -> None:
    """The launcher signals the workers first and stops them later; a second SIGTERM during a clean exit would
    land after Python restored the default handler and kill the child (-15)."""
    supervisor = Supervisor(RestartPolicy())
    worker = supervisor.add(child(tmp_path, "worker-1", "", "count-term"))
    wait_for(lambda: "ready" in worker.log_path.read_text(), 10, "the child to install its handler")
    supervisor.signal(["worker-1"])
    time.sleep(0.2)  # (the launcher stops the learner in between; signals this close together would coalesce)
    supervisor.stop(["worker-1"], 10)
    assert worker.exit_codes == [1]


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    events: list[str] = []
    supervisor = Supervisor(RestartPolicy(), on_event=events.append)
    stubborn = supervisor.add(child(tmp_path, "worker-3", "", "ignore-term"))
    wait_for(lambda: "start 0" in stubborn.log_path.read_text(), 20, "the child to install its handler")
    supervisor.stop(["worker-3"], timeout_s=0.5)
    assert not stubborn.alive() and stubborn.exit_codes == [-signal.SIGKILL]
    assert events == ["worker-3 did not stop within 0 s; killed"]


def test_a_pending_restart_is_cancelled_by_stop(tmp_path: Path) -> None:
    supervisor = Supervisor(RestartPolicy(backoff_s=30))
    worker = supervisor.add(child(tmp_path, "worker-4", "1"))
    run_until(supervisor, lambda: worker.restart_at_s is not None)
    supervisor.stop(["worker-4"], timeout_s=1)
    supervisor.check(now_s=time.monotonic() + 60)
    assert starts(tmp_path, "worker-4") == 1


# a child that marks its timeline as a role does (loraflow.common.timeline), says one last line and exits 2
CONFIG_CLASS = """
import sys
from loraflow.common.timeline import Timeline
timeline = Timeline(sys.argv[1])
for state in sys.argv[2].split(","):
    timeline.mark(state)
print("worker_started", flush=True)
print(sys.argv[3], flush=True)
sys.exit(2)
"""


@pytest.mark.parametrize("states, wording", [
    ("starting", "worker-1 refused to start (exit code 2: a usage or config error): "),  # a start-up check
    ("starting,idle,generating", "worker-1 stopped with a config-class error (exit code 2, after "),  # mid-run
])
def test_exit_2_is_worded_by_whether_the_child_had_started(tmp_path: Path, states: str, wording: str) -> None:
    """A worker whose reward fails on every sample (or whose adapter the engine refuses) exits 2 mid-run: not
    restarted like a start-up error, but not worded as one; the last log line (the reason) is in the message."""
    script = tmp_path / "config_class.py"
    script.write_text(CONFIG_CLASS)
    timeline = tmp_path / "timeline" / "worker-1.jsonl"
    earlier = Timeline(timeline)  # an earlier incarnation that had started: not this one's
    earlier.mark("generating")
    earlier.close()
    last = "reward_failing error='every sample of 8 groups in a row failed its reward'"
    supervisor = Supervisor(RestartPolicy(backoff_s=0.05))
    worker = supervisor.add(Managed(name="worker-1", argv=[sys.executable, str(script), str(timeline), states, last],
                                    log_path=tmp_path / "logs" / "worker-1.log", env=child_env(),
                                    timeline_path=timeline))
    with pytest.raises(ConfigClassExit) as stopped:
        run_until(supervisor, lambda: False)
    message = str(stopped.value)
    assert message.startswith(wording) and message.splitlines()[0].endswith(f": {last}; see {worker.log_path}:")
    assert worker.exit_codes == [2] and worker.num_restarts == 0


RANK_SCRIPT = """
import os, sys, time
print("rank-pid", os.getpid(), flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_sigkill_reaches_torchruns_ranks_in_their_own_sessions(tmp_path: Path) -> None:
    """torchrun starts each rank in a session of its own and forwards nothing once SIGKILLed: the kill goes to
    every process below the child too, or the ranks would live on (holding their GPU memory)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    learner = Managed(name="learner", argv=[sys.executable, *one_host_torchrun(2), str(script)],
                      log_path=tmp_path / "logs" / "learner.log", env=child_env())
    learner.start()

    def rank_pids() -> list[int]:
        return [int(line.split()[-1]) for line in learner.log_path.read_text().splitlines()
                if line.strip().endswith(tuple("0123456789")) and "rank-pid" in line]

    pids = wait_for(lambda: len(rank_pids()) == 2 and rank_pids(), 120, "both ranks to start")
    assert all(os.getsid(pid) == pid for pid in pids)  # sessions of their own: the child's session is not theirs
    learner.signal(signal.SIGKILL)
    learner.wait(10)

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
        except OSError:
            return True

    wait_for(lambda: all(gone(pid) for pid in pids), 10, "the ranks to be killed")
