"""Rewards: environments score their episodes; reward functions named in config may replace that score.

Two signatures are accepted, told apart by the function's parameters (one with a ``completions`` parameter is
TRL-style):

**TRL-style** (``worker.reward = "mod:f"``, or several: ``worker.rewards = ["mod:f", "mod:g"]`` with
``worker.reward_weights``), exactly what TRL's GRPOTrainer calls, so a user's functions work unchanged::

    def f(prompts, completions, completion_ids, **kwargs) -> list[float | None]

called once per group when all its samples are done (:mod:`.group`). ``prompts`` holds each sample's prompt (a
string or a message list), ``completions`` the decoded completions (text, or ``[{"role": "assistant",
"content": ...}]`` for conversational prompts), ``completion_ids`` the token ids, and every other column of the
dataset row is a keyword argument holding one value per sample (``answer`` always; see common/dataset.py).
None means "does not apply to this sample". As in TRL, the sample's reward is the weighted sum over functions
with None left out (NaN + nansum); a sample no function applies to gets 0 (counted ``rewards_all_none``). Each
function's mean over the samples it applied to travels with the group (``RolloutGroup.reward_means``) and the
learner logs its mean per step (``reward_components`` in metrics.jsonl). Unlike TRL there is no
``trainer_state`` keyword: workers do not know the learner's step.

**loraflow's per-sample signature** (``worker.reward`` only), kept for existing code::

    def f(completion: str, answer: str, *, prompt, task: str, meta: dict, finished: bool) -> float

called once per finished sample, in the sample's environment thread, right after the environment's last step.

Built-in TRL-style functions are named ``loraflow:exact_match`` and ``loraflow:format`` (:mod:`.builtin`).
Modules are imported from the worker's working directory too (as a script run from there would), then from
installed packages. Everything runs guarded (:mod:`.guard`): an exception, a hang past
``worker.reward_timeout_s`` or a value that is not a finite number (or, batched, not one per sample) scores the
samples 0, is counted (``reward_failures{reason}`` per sample, ``reward_failures_by_function{function,
reason}``) and logged with the function's name.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from loraflow.common.config import ConfigError, WorkerConfig
from loraflow.rollout_worker.plugins import load_object
from loraflow.rollout_worker.rewards.builtin import BUILTIN_REWARDS
from loraflow.rollout_worker.rewards.guard import (
    FAILURE_REASONS,
    Attributed,
    GuardedCall,
    InvalidReward,
    Outcome,
    as_reward,
    call_guarded,
)

RewardFn = Callable[..., float]
BUILTIN_PREFIX = "loraflow:"

__all__ = ["FAILURE_REASONS", "Attributed", "GuardedCall", "InvalidReward", "Outcome", "RewardFn", "RewardFunction", "RewardSet",
           "as_reward", "call_guarded", "is_batched", "load_reward", "load_rewards"]


@dataclass(frozen=True, slots=True)
class RewardFunction:
    """One TRL-style reward function, its weight and the name its metrics and failures go by."""

    name: str
    fn: Callable[..., list[float | None]]
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class RewardSet:
    """What scores a worker's samples besides the environment: per-sample (loraflow's) or batched (TRL's)."""

    per_sample: RewardFn | None = None
    per_sample_name: str = ""
    batched: tuple[RewardFunction, ...] = field(default_factory=tuple)

    @property
    def empty(self) -> bool:
        return self.per_sample is None and not self.batched


def is_batched(fn: Callable[..., object]) -> bool:
    """TRL-style (batched over a group) when the function has a ``completions`` parameter."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: loraflow's per-sample call is the default
        return False


def _import_path() -> None:
    """The working directory is importable, as for ``python script.py`` run from there (console scripts and
    ``python -m`` under another directory do not put it on sys.path)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _load(spec: str, setting: str) -> tuple[str, Callable[..., object]]:
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_REWARDS:
            raise ConfigError(f"{setting} = {spec!r}: no such built-in reward; built in: "
                              f"{[BUILTIN_PREFIX + n for n in BUILTIN_REWARDS]}")
        return name, BUILTIN_REWARDS[name]
    _import_path()
    fn = load_object(spec, setting)
    if not callable(fn):
        raise ConfigError(f"{setting} = {spec!r} is not callable; name a function (package.module:function)")
    return getattr(fn, "__name__", spec.rpartition(":")[2]), fn


def load_reward(spec: str) -> RewardFn | None:
    """The function ``worker.reward`` names (either signature), or None when it is empty."""
    return _load(spec, "worker.reward")[1] if spec else None


def load_rewards(worker: WorkerConfig) -> RewardSet:
    """``worker.reward`` / ``worker.rewards`` / ``worker.reward_weights`` resolved; raises ConfigError."""
    if worker.reward:
        name, fn = _load(worker.reward, "worker.reward")
        if is_batched(fn):
            return RewardSet(batched=(RewardFunction(name=name, fn=fn),))
        return RewardSet(per_sample=fn, per_sample_name=name)
    weights = worker.reward_weights or [1.0] * len(worker.rewards)
    functions: list[RewardFunction] = []
    for i, (spec, weight) in enumerate(zip(worker.rewards, weights, strict=True)):
        name, fn = _load(spec, f"worker.rewards[{i}]")
        if not is_batched(fn):
            raise ConfigError(f"worker.rewards[{i}] = {spec!r} has loraflow's per-sample signature; worker.rewards "
                              "takes TRL-style functions f(prompts, completions, completion_ids, **kwargs) (a "
                              "per-sample function goes in worker.reward)")
        taken = {f.name for f in functions}
        functions.append(RewardFunction(name=name if name not in taken else f"{name}_{i}", fn=fn, weight=weight))
    return RewardSet(batched=tuple(functions))
