"""User code loaded by import path in tests: an environment and reward functions, some of them broken."""

from __future__ import annotations

import itertools
import time
from typing import Any

from loraflow.rollout_worker.envs import Environment, Episode, Step

_calls = itertools.count()


class CountingEnv(Environment):
    """Single turn; reward = number of characters the model wrote (a user environment by import path)."""

    max_turns = 1

    def step(self, state: Any, turn: str, *, finished: bool, episode: Episode) -> Step:
        return Step(done=True, reward=float(len(turn)))


def length_reward(completion: str, answer: str, **info: Any) -> float:
    return float(len(completion)) + (0.5 if info["finished"] else 0.0)


def broken_reward(completion: str, answer: str, **info: Any) -> float:
    """Cycles through: raises, NaN, hangs for a minute, a proper 1.0."""
    kind = next(_calls) % 4
    if kind == 0:
        raise RuntimeError("reward service unavailable")
    if kind == 1:
        return float("nan")
    if kind == 2:
        time.sleep(60)
    return 1.0


not_an_env = 42
