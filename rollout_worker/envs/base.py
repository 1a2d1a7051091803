"""Environments: what happens between the model's turns, and what an episode is worth.

An episode is one sample of a group. The model speaks a turn (until end-of-sequence, one of the environment's
``stop_strings``, or ``worker.max_new_tokens``); then the environment's :meth:`Environment.step` answers:

    Step(done=True, reward=r)        the episode is over, worth r
    Step(done=False, reply="...")    the reply's tokens join the sequence (loss mask 0, log-prob 0) and the
                                     model speaks again, up to ``max_turns`` model turns

A single-turn task is an environment whose first step is done. Each step runs in a guarded thread of its own
(:mod:`loraflow.rollout_worker.rewards.guard`): a slow tool call of one sample never holds up the generation of the other
samples, and a step that raises, hangs past ``worker.reward_timeout_s`` or returns a non-finite reward scores 0.

User environments are named in config as ``worker.env = "package.module:Name"``: a subclass of
:class:`Environment` (instantiated without arguments) or an instance. One environment object serves every
sample, from several threads at once: keep per-episode state in what :meth:`Environment.start` returns.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from loraflow.common.task_base import Prompt


@dataclass(slots=True, kw_only=True)
class Step:
    """The environment's answer to a model turn."""

    done: bool
    reward: float = 0.0  # used when done
    reply: str = ""  # used when not done: text appended to the sequence before the model's next turn


@dataclass(frozen=True, slots=True, kw_only=True)
class Episode:
    """What an environment knows about the sample it serves (from the lease)."""

    prompt: Prompt  # a string, or chat messages (TRL's conversational format)
    answer: str
    task: str
    meta: dict[str, Any] = field(default_factory=dict)
    group_id: str = ""
    index: int = 0  # sample index in the group
    columns: dict[str, Any] = field(default_factory=dict)  # the dataset row's other columns (common/dataset.py)


class Environment(abc.ABC):
    """Turns of one episode: the model speaks, the environment answers, until done."""

    #: a model turn ends right after any of these strings (e.g. the end of a tool call)
    stop_strings: tuple[str, ...] = ()
    #: model turns per episode; None = worker.max_turns
    max_turns: int | None = None

    def start(self, episode: Episode) -> Any:
        """Per-episode state passed to every step (default: none)."""
        return None

    @abc.abstractmethod
    def step(self, state: Any, turn: str, *, finished: bool, episode: Episode) -> Step:
        """Answer the model's latest turn. ``turn`` is its text (without EOS); ``finished``: it ended with EOS."""
