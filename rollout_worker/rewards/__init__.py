"""Rewards: environments score their episodes; ``worker.reward`` may replace that score with a user function.

A reward function named in config (``package.module:function``) is called once per finished sample as::

    fn(completion: str, answer: str, *, prompt: str, task: str, meta: dict, finished: bool) -> float

where ``completion`` is the decoded text after the prompt (model turns and environment replies) and
``finished`` says whether the model ended with end-of-sequence. It runs guarded (:mod:`.guard`): an exception,
a hang past ``worker.reward_timeout_s`` or a non-finite value gives reward 0, a counter and a log line.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_worker.plugins import load_object
from rollout_worker.rewards.guard import (
    FAILURE_REASONS,
    GuardedCall,
    InvalidReward,
    Outcome,
    as_reward,
    call_guarded,
)

RewardFn = Callable[..., float]

__all__ = ["FAILURE_REASONS", "GuardedCall", "InvalidReward", "Outcome", "RewardFn", "as_reward", "call_guarded",
           "load_reward"]


def load_reward(spec: str) -> RewardFn | None:
    """The reward function ``worker.reward`` names, or None when it is empty."""
    if not spec:
        return None
    fn = load_object(spec, "worker.reward")
    if not callable(fn):
        raise ValueError(f"worker.reward = {spec!r} is not callable")
    return fn
