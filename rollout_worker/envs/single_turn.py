"""Single-turn tasks: prompt -> completion -> exact-answer reward (loraflow.common.tasks' scoring rule)."""

from __future__ import annotations

from typing import Any

from loraflow.common.task_base import Task
from loraflow.rollout_worker.envs.base import Environment, Episode, Step


class SingleTurnEnv(Environment):
    """One model turn, scored by ``task.score``: 1 for exactly the answer followed by end-of-sequence."""

    max_turns = 1

    def __init__(self, task: Task | None = None) -> None:
        self.task = task or Task()

    def step(self, state: Any, turn: str, *, finished: bool, episode: Episode) -> Step:
        return Step(done=True, reward=self.task.score(turn, episode.answer, finished=finished))
