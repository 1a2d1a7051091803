"""The pool learner's turns on its one base (learner/pool_learner.py StepTurns): contending runs get steps in
proportion to their run.weight; a run with nothing to train holds nobody back; a run that joins late starts level
with the others (within StepTurns.SLACK) instead of being owed the steps it was not there for."""

from __future__ import annotations

import threading
import time

from loraflow.learner.pool_learner import StepTurns

STEP_S = 0.004


def contend(turns: StepTurns, weights: dict[str, float], seconds: float) -> dict[str, int]:
    stop = threading.Event()

    def loop(run: str, weight: float) -> None:
        while not stop.is_set():
            with turns.turn(run, weight):
                time.sleep(STEP_S)

    threads = [threading.Thread(target=loop, args=item) for item in weights.items()]
    before = dict(turns.steps)
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return {run: turns.steps.get(run, 0) - before.get(run, 0) for run in weights}


def test_contending_runs_share_steps_by_weight() -> None:
    steps = contend(StepTurns(), {"a": 1.0, "b": 3.0}, 1.5)
    assert abs(steps["b"] / (steps["a"] + steps["b"]) - 0.75) <= 0.75 * 0.15, steps
    even = contend(StepTurns(), {"a": 1.0, "b": 1.0, "c": 1.0}, 1.0)
    assert max(even.values()) - min(even.values()) <= 2, even


def test_an_idle_run_holds_nobody_back_and_a_late_one_is_owed_nothing() -> None:
    turns = StepTurns()
    alone = contend(turns, {"a": 1.0}, 0.5)["a"]
    assert alone >= 0.5 / STEP_S * 0.5  # no other run waiting: a goes on at once, step after step
    steps = contend(turns, {"a": 1.0, "late": 1.0}, 0.5)
    assert abs(steps["a"] - steps["late"]) <= 2 + StepTurns.SLACK, steps  # late did not get a's earlier steps back first
