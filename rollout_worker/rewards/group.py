"""Scoring a whole group with TRL-style reward functions, as GRPOTrainer does, guarded per function.

When every sample of a group is done, :class:`GroupScoring` calls each function of the :class:`RewardSet` once
with the group's samples, in a guarded thread of its own (:mod:`.guard`; they run side by side, each with
``worker.reward_timeout_s``). The worker loop polls it between chunk rounds; when all calls are back,
:meth:`GroupScoring.result` combines them like TRL::

    rewards_per_func[s, f] = output_f[s], None -> NaN
    reward[s]              = nansum_f(weight_f * rewards_per_func[s, f])   (all NaN -> 0, counted)
    reward_means[f]        = nanmean_s(rewards_per_func[s, f])             (absent when all NaN)

A function that raises, hangs, or returns anything but one finite number or None per sample fails the group:
every sample scores 0 (finish reason ``error``), as a failing per-sample reward always did, and the failure
is reported under that function's name. Inputs (decoded text) are built in the worker loop's thread before the
calls start: no tokenizer use in the reward threads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraflow.common.chat import completion_for
from loraflow.rollout_worker.rewards import RewardFunction
from loraflow.rollout_worker.rewards.guard import GuardedCall, InvalidReward, as_reward

#: argument names of the call; dataset columns of these names are not passed (TRL leaves out the same three)
RESERVED = ("prompts", "completions", "completion_ids")


@dataclass(slots=True, kw_only=True)
class GroupInputs:
    """What each reward function is called with, one entry per sample."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, Any] = field(default_factory=dict)  # the lease's columns (one value for the whole group)

    def kwargs(self) -> dict[str, Any]:
        n = len(self.completions)
        extra = {k: [v] * n for k, v in self.columns.items() if k not in RESERVED}
        return {"prompts": self.prompts, "completions": self.completions, "completion_ids": self.completion_ids,
                **extra}


@dataclass(slots=True, kw_only=True)
class Failure:
    function: str
    reason: str
    error: str


@dataclass(slots=True, kw_only=True)
class GroupScore:
    """The combined rewards of a group, or the failures that zeroed it."""

    rewards: list[float]
    means: dict[str, float]
    failures: list[Failure]
    num_all_none: int = 0  # samples no function applied to (reward 0)
    duration_s: float = 0.0  # the longest call


def inputs_for(prompt: Any, columns: dict[str, Any], completion_ids: list[list[int]],
               decode: Callable[[Sequence[int]], str]) -> GroupInputs:
    """The call's inputs for one group: completions decoded (special tokens dropped), in TRL's conversational
    form when the prompt is a conversation."""
    texts = [decode(ids) for ids in completion_ids]
    return GroupInputs(prompts=[prompt] * len(texts), completions=[completion_for(prompt, t) for t in texts],
                       completion_ids=[list(ids) for ids in completion_ids], columns=columns)


def as_rewards(value: Any, num_samples: int) -> list[float | None]:
    """One finite float or None per sample from what a batched reward returned, else InvalidReward."""
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
        raise InvalidReward(f"a batched reward must return a list, got {type(value).__name__}", "type")
    values = list(value)
    if len(values) != num_samples:
        raise InvalidReward(f"a batched reward must return {num_samples} values (one per sample), got "
                            f"{len(values)}", "type")
    return [None if v is None else as_reward(v.item() if hasattr(v, "item") and not isinstance(v, numbers.Real)
                                             else v) for v in values]


def _checked(function: RewardFunction, num_samples: int) -> Callable[..., list[float | None]]:
    def call(**kwargs: Any) -> list[float | None]:
        return as_rewards(function.fn(**kwargs), num_samples)

    call.__name__ = function.name  # what a stuck call is reported as (guard.RunawayWatch)
    return call


class GroupScoring:
    """The reward calls of one group in flight (see the module docstring)."""

    def __init__(self, functions: Sequence[RewardFunction], inputs: GroupInputs, *, timeout_s: float,
                 on_done: Callable[[], None] | None = None) -> None:
        self.functions = list(functions)
        self.num_samples = len(inputs.completions)
        kwargs = inputs.kwargs()
        self.calls = [GuardedCall(_checked(f, self.num_samples), timeout_s=timeout_s, on_done=on_done, **kwargs)
                      for f in self.functions]

    @property
    def deadline(self) -> float:
        return max(call.deadline for call in self.calls)

    def result(self, now: float | None = None) -> GroupScore | None:
        """The group's score once every call returned or timed out; None while one is still running."""
        outcomes = [call.poll(now) for call in self.calls]
        if any(o is None for o in outcomes):
            return None
        duration_s = max(o.duration_s for o in outcomes if o is not None)
        failures = [Failure(function=f.name, reason=o.failure, error=o.error)
                    for f, o in zip(self.functions, outcomes, strict=True) if o is not None and not o.ok]
        if failures:
            return GroupScore(rewards=[0.0] * self.num_samples, means={}, failures=failures, duration_s=duration_s)
        columns = [o.value for o in outcomes if o is not None]
        rewards, num_all_none = [], 0
        for s in range(self.num_samples):
            applied = [(f.weight, values[s]) for f, values in zip(self.functions, columns, strict=True)
                       if values[s] is not None]
            num_all_none += not applied
            rewards.append(math.fsum(w * v for w, v in applied))
        means = {}
        for f, values in zip(self.functions, columns, strict=True):
            present = [v for v in values if v is not None]
            if present:
                means[f.name] = math.fsum(present) / len(present)
        return GroupScore(rewards=rewards, means=means, failures=[], num_all_none=num_all_none, duration_s=duration_s)
