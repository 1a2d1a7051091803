"""Plots that tell the truth: a lane ends at its process's last sign of life, busy shares count the time alive,
a learner restart's withdrawn steps leave the committed history, and a plot claims only what the run measured.

Run directories come from the real writers: real processes marking a Timeline (one SIGKILLed, one stopped with
SIGTERM, one crashing), a Timeline driven with an explicit clock, and MetricsLog lines of three learner
sessions. Assertions are on the computed lanes, shares and history, and on the figures' words, not on pixels.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from loraflow.common.timeline import ALIVE_EVERY_S, Timeline, read_lives
from loraflow.deploy import plots, rundir
from loraflow.learner.metrics_log import MetricsLog
from tests.support import Processes, wait_for

CHILD = r"""
import signal, sys, time
from loraflow.common.timeline import Timeline
run_dir, name, how = sys.argv[1:4]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
timeline = Timeline.for_process(run_dir, name)
timeline.mark("starting")
timeline.mark("generating")
time.sleep(1.0)
timeline.mark("waiting")
if how == "crash":
    raise RuntimeError("a crash after the marks")
while not stop:
    time.sleep(0.05)
timeline.close()
"""


def lines(path: Path) -> list[dict]:
    out = []
    for raw in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):  # a torn line
            out.append(json.loads(raw))
    return out


def test_lanes_of_a_killed_a_stopped_and_a_crashed_process(procs: Processes, tmp_path: Path) -> None:
    def child(name: str, how: str):
        return procs.spawn(name, [sys.executable, "-c", CHILD, str(tmp_path), name, how])

    victim, survivor, crasher = child("worker-1", "kill"), child("worker-2", "term"), child("worker-3", "crash")
    victim_path = tmp_path / "timeline" / "worker-1.jsonl"
    survivor_path = tmp_path / "timeline" / "worker-2.jsonl"
    # killed while waiting, after alive lines carried its life past its last state change
    wait_for(lambda: sum("alive" in x for x in lines(victim_path)) >= 2, 60, "two alive lines", procs)
    victim.kill()
    killed_at = time.time()
    wait_for(lambda: any(x["t"] > killed_at + 1.5 for x in lines(survivor_path)), 60, "the survivor later", procs)
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(30) == 0, survivor.log()
    assert crasher.wait(30) == 1, crasher.log()

    lanes = rundir.timelines(tmp_path, now_s=time.time() + 60)  # read after the run (no processes.jsonl: by hand)
    killed = lanes["worker-1"]
    (life,) = killed.lives
    waiting_t = life.transitions[-1][0]
    assert life.ended == "lost" and life.transitions[-1][1] == "waiting"
    assert waiting_t + ALIVE_EVERY_S <= life.end_s <= killed_at + 0.05  # its last sign of life, not later
    assert life.end_s >= killed_at - 2 * ALIVE_EVERY_S - 2.0  # an alive line at most a period or two before
    assert killed.spans()[-1] == (waiting_t, life.end_s, "waiting")
    stopped = lanes["worker-2"]
    assert stopped.lives[0].ended == "stopped" and stopped.lives[0].end_s > killed_at + 1.5
    assert lanes["worker-3"].lives[0].ended == "exited"  # the interpreter's exit wrote it (atexit)
    # busy over the time alive: generating ~1 s of the ~2+ s it lived, not of the whole run
    generating_t = life.transitions[1][0]
    assert killed.busy_share() == pytest.approx((waiting_t - generating_t) / (life.end_s - generating_t))
    assert killed.busy_share() > (waiting_t - generating_t) / (stopped.lives[0].end_s - generating_t)


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def restarted_learner(tmp_path: Path, *, check_running: bool = False) -> Path:
    """A learner timeline of two lives: killed at ~t0 + 3 in training, restarted at t0 + 100, stopped at t0 + 104."""
    clock = Clock()
    path = tmp_path / "timeline" / "learner.jsonl"
    t0 = clock.now
    first = Timeline(path, clock=clock, alive_every_s=0)
    first.mark("starting")
    clock.now = t0 + 1
    first.mark("training")
    clock.now = t0 + 3
    first.keepalive()  # an alive line at t0 + 3 (with alive_every_s = 0 one is due at every call)
    clock.now = t0 + 100  # the process was SIGKILLed at ~t0 + 3: nothing more from it
    second = Timeline(path, clock=clock, alive_every_s=0)  # the restarted process
    second.mark("starting")
    clock.now = t0 + 101
    second.mark("waiting")
    clock.now = t0 + 102
    second.mark("training")
    clock.now = t0 + 104
    second.keepalive()
    if check_running:
        assert rundir.timelines(tmp_path, now_s=t0 + 105)["learner"].lives[-1].ended == "running"  # a fresh line
        assert rundir.timelines(tmp_path, now_s=t0 + 110)["learner"].lives[-1].ended == "lost"  # silent since
    second.close()
    second.mark("waiting")  # after the final mark: ignored
    return path


def test_a_restart_ends_the_dead_life_and_busy_share_counts_only_time_alive(tmp_path: Path) -> None:
    path = restarted_learner(tmp_path, check_running=True)
    t0 = Clock().now
    lanes = rundir.timelines(tmp_path, now_s=t0 + 200)
    lane = lanes["learner"]
    assert [(life.start_s, life.end_s, life.ended) for life in lane.lives] == [
        (t0, t0 + 3, "lost"), (t0 + 100, t0 + 104, "stopped")]
    assert lane.spans() == [(t0, t0 + 1, "starting"), (t0 + 1, t0 + 3, "training"),
                            (t0 + 100, t0 + 101, "starting"), (t0 + 101, t0 + 102, "waiting"),
                            (t0 + 102, t0 + 104, "training")]
    assert lane.restarts() == [t0 + 100] and lane.outages() == [(t0 + 3, t0 + 100)]
    assert lane.busy_share() == 4 / 5  # training 2 + 2 s of 5 s alive (start-up not counted), not of 104 s
    assert lane.alive_s() == 7

    # under loraflow run the launcher's exit record says when and how the first life ended
    rundir.append_jsonl(rundir.processes_path(tmp_path), {"t": t0 + 3.4, "process": "learner", "event": "exit",
                                                          "pid": 1, "code": -9})
    first_life = rundir.timelines(tmp_path, now_s=t0 + 200)["learner"].lives[0]
    assert (first_life.end_s, first_life.ended) == (t0 + 3.4, "killed")
    # and its start record when the restarted process began: its start-up before the first mark is not downtime
    for t in (t0 + 20, t0 + 90):  # the first restart crashed before marking anything
        rundir.append_jsonl(rundir.processes_path(tmp_path), {"t": t, "process": "learner", "event": "start"})
    lane = rundir.timelines(tmp_path, now_s=t0 + 200)["learner"]
    assert lane.outages() == [(t0 + 3.4, t0 + 90)] and lane.spans()[2] == (t0 + 90, t0 + 101, "starting")
    assert lane.busy_share() == pytest.approx(4.4 / 5.4) and lane.ready_s() == pytest.approx(5.4)
    assert [life.ended for life in read_lives(path)] == ["", "stopped"]


def test_alive_lines_only_when_nothing_else_was_written(tmp_path: Path) -> None:
    clock = Clock()
    timeline = Timeline(tmp_path / "w.jsonl", clock=clock, alive_every_s=5)
    timeline.keepalive()  # before the first mark: nothing to keep alive
    timeline.mark("waiting")
    clock.now += 4
    timeline.keepalive()
    clock.now += 1
    timeline.keepalive()
    clock.now += 3
    timeline.mark("generating")
    clock.now += 4
    timeline.keepalive()
    timeline.close()
    kinds = [("alive" if "alive" in x else x["state"]) for x in lines(tmp_path / "w.jsonl")]
    assert kinds == ["waiting", "alive", "generating", "stopped"]
    assert "pid" in lines(tmp_path / "w.jsonl")[0]


def write_sessions(path: Path) -> list[dict]:
    """Three learner sessions: A (fresh) reaches step 5, checkpoint at 4; B resumes at 4 and reaches 7,
    checkpoint at 6; C resumes at 6 and reaches 8. Each line carries its reward as session + step / 100."""
    seen: list[dict] = []
    t = 1_800_000_000.0
    for session, resumed, last, reward in (("A", 0, 5, 0.0), ("B", 4, 7, 0.1), ("C", 6, 8, 0.2)):
        log = MetricsLog(path, session=session, resumed_step=resumed, sinks=[seen.append])
        for step in range(resumed + 1, last + 1):
            t += 1
            log.emit({"step": step, "time_unix": t, "reward_mean": reward + step / 100,
                      "staleness": {"0": 1, "1": 1}, "staleness_zero_variance": {"1": 2}})
        t += 10  # down for a while
    return seen


def test_a_learner_restart_withdraws_the_rolled_back_steps(tmp_path: Path) -> None:
    seen = write_sessions(rundir.metrics_path(tmp_path))
    raw = rundir.read_jsonl(rundir.metrics_path(tmp_path))
    assert raw == seen  # the sinks get exactly what the file gets
    assert [(x["session"], x["step"]) for x in raw][4:7] == [("A", 5), ("B", 5), ("B", 6)]  # same numbers twice
    history = rundir.read_learner_history(tmp_path)
    assert [(x["session"], x["step"]) for x in history.committed] == [
        ("A", 1), ("A", 2), ("A", 3), ("A", 4), ("B", 5), ("B", 6), ("C", 7), ("C", 8)]
    assert [(x["session"], x["step"]) for x in history.withdrawn] == [("A", 5), ("B", 7)]
    assert [(r.session, r.step) for r in history.resumes] == [("B", 4), ("C", 6)]
    # the staleness plot counts the committed steps' groups only (a withdrawn step's groups were trained again)
    with_gradient, without = plots.staleness_counts(history.committed)
    assert (with_gradient, without) == ({0: 8, 1: 8}, {1: 16})


def test_history_of_a_file_without_sessions_is_cut_where_the_step_goes_back() -> None:
    steps = [{"step": s} for s in (1, 2, 3, 2, 3, 4)]
    history = rundir.learner_history(steps)
    assert [x["step"] for x in history.committed] == [1, 2, 3, 4] and history.committed[1] is steps[3]
    assert [x["step"] for x in history.withdrawn] == [2, 3] and [r.step for r in history.resumes] == [1]


def words(fig) -> str:
    """Every piece of text a figure shows: titles, axis labels, legends, notes."""
    texts = [t.get_text() for t in fig.texts]
    if fig._suptitle is not None:
        texts.append(fig._suptitle.get_text())
    for ax in fig.axes:
        texts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), *(t.get_text() for t in ax.texts)]
        legend = ax.get_legend()
        if legend is not None:
            texts += [t.get_text() for t in legend.get_texts()]
    for legend in fig.legends:
        texts += [t.get_text() for t in legend.get_texts()]
    return "\n".join(texts)


def test_learning_plot_claims_accuracy_only_where_it_was_measured(tmp_path: Path) -> None:
    write_sessions(rundir.metrics_path(tmp_path))  # a by-hand run: no evals.jsonl
    history = rundir.read_learner_history(tmp_path)
    by_hand = plots.learning_figure(history, [], None, 1_800_000_000.0)
    text = words(by_hand)
    assert "accuracy" not in text.replace("no held-out accuracy measured", "")
    assert "mean reward" in text and "learner restart" in text and "withdrawn steps" in text
    evals = [{"version": 0, "step": 0, "accuracy": 0.3, "time_unix": 1_800_000_000.0, "kind": "base"}]
    measured = plots.learning_figure(history, evals, None, 1_800_000_000.0)
    assert "held-out greedy accuracy" in words(measured) and "reward / accuracy" in words(measured)


def test_staleness_plot_says_what_it_counts() -> None:
    new = [{"step": 1, "staleness": {"0": 3}, "staleness_zero_variance": {"0": 1}}]
    assert "3 with a gradient, 1 without" in words(plots.staleness_figure(new))
    old = [{"step": 1, "staleness": {"0": 3}}]  # a run from before the zero-variance count
    assert "groups trained with a gradient" in words(plots.staleness_figure(old))


def test_timeline_plot_marks_deaths_restarts_and_time_alive(tmp_path: Path) -> None:
    restarted_learner(tmp_path)
    lanes = rundir.timelines(tmp_path, now_s=1_800_000_200.0)
    text = words(plots.timeline_figure(lanes, 1_800_000_000.0))
    assert "80% busy of 5 s ready\n (7 s alive)" in text and "restart" in text and "ended without a final mark" in text
    assert "stopped cleanly" in text and "down (between a death and its restart)" in text
    write_sessions(rundir.metrics_path(tmp_path))
    assert [p.name for p in plots.plot_run(tmp_path, now_s=1_800_000_200.0)] == [
        "learning.png", "staleness.png", "timeline.png"]
