"""The state of a leased group's rollout: each sample's tokens, their versions and loss mask, where the sample
stands, and the group's evidence; and the :class:`FinishedGroup` a complete group becomes.

    a sample's status   READY (waits for the engine) -> GENERATING (a streamed request runs its turn) -> READY
                        ... -> IN_ENV (an environment step in flight) -> READY (next turn) or DONE

Every token records the version that produced it (environment tokens: the current version when they are
appended). A group's ``min_version`` is the oldest version of any of its tokens, ``max_version`` the newest: the
staleness rule keeps a group while its newest token is within ``max_staleness`` and the learner masks the older
tokens (:mod:`loraflow.common.versions`), so a long ``continue`` sample is not dropped for having started early.

Evidence. A group keeps, per version of its tokens, what the engine served that version with
(:class:`loraflow.common.protocol.ServedAdapter`): for generated tokens the backend's report of the very request
(``GenOutput.served``), for environment tokens ``backend.served`` of the current version. The RolloutGroup's
``served`` lists exactly the distinct versions of its ``versions`` tensor (checked by the learner,
:mod:`loraflow.common.integrity`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loraflow.common.chat import Message
from loraflow.common.protocol import PromptLease, RolloutGroup, ServedAdapter
from loraflow.rollout_worker.envs import Environment, Episode
from loraflow.rollout_worker.rewards import GuardedCall
from loraflow.rollout_worker.rewards.group import GroupScoring

READY, GENERATING, IN_ENV, DONE = "ready", "generating", "env", "done"


@dataclass(slots=True, kw_only=True)
class Sample:
    """One episode of a group: its tokens so far and where it stands."""

    index: int
    episode: Episode
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    status: str = READY
    turn: int = 0  # model turns completed
    turn_start: int = 0  # index in completion_ids where the current model turn began
    turn_tokens: int = 0  # tokens generated in the current model turn
    version: int | None = None  # version of the episode's first generated token (None: nothing generated yet)
    env_state: Any = None
    call: GuardedCall | None = None  # the environment step in flight
    turn_end: str = ""  # how the last model turn ended: eos, stop_string (worker.stop_strings), stop or length
    turn_text: str = ""  # the last model turn's text, as the environment got it
    messages: list[Message] | None = None  # the conversation so far (conversational prompts through a template)
    finish_reason: str = ""
    reward: float = 0.0
    num_aborts: int = 0
    request_id: str = ""  # the request streaming this sample's turn (status GENERATING)
    request_version: int = 0  # the version that request runs under

    def append(self, token_ids: list[int], logprobs: list[float], version: int, trained: bool) -> None:
        self.completion_ids += token_ids
        self.logprobs += logprobs
        self.versions += [version] * len(token_ids)
        self.loss_mask += [int(trained)] * len(token_ids)

    def truncate(self, length: int) -> None:
        for tokens in (self.completion_ids, self.logprobs, self.versions, self.loss_mask):
            del tokens[length:]


@dataclass(slots=True, kw_only=True)
class GroupRollout:
    """A leased group under way: its samples, the engine's evidence per version, and what it cost so far."""

    lease: PromptLease
    env: Environment
    prompt_ids: list[int]
    samples: list[Sample]
    start_version: int
    started_unix: float = field(default_factory=time.time)
    generate_s: float = 0.0
    reward_s: float = 0.0
    num_reward_failures: int = 0
    scoring: GroupScoring | None = None  # TRL-style rewards of the group in flight (all samples done)
    reward_means: dict[str, float] | None = None
    served: dict[int, ServedAdapter] = field(default_factory=dict)  # version -> the engine's evidence

    @property
    def done(self) -> bool:
        return all(s.status == DONE for s in self.samples)


@dataclass(slots=True, kw_only=True)
class FinishedGroup:
    """A complete group, ready to submit: the RolloutGroup header and its tensors (numpy, in wire order)."""

    group: RolloutGroup
    tensors: list[tuple[str, np.ndarray]]


def assemble(group: GroupRollout, worker_id: str) -> FinishedGroup:
    """The RolloutGroup header and tensors of a group whose samples are all done (and scored)."""
    samples = group.samples
    versions = [v for s in samples for v in s.versions]
    header = RolloutGroup(
        group_id=group.lease.group_id, lease_id=group.lease.lease_id, worker_id=worker_id,
        task=group.lease.task[:128], prompt_lens=[len(group.prompt_ids)] * len(samples),
        completion_lens=[len(s.completion_ids) for s in samples], rewards=[s.reward for s in samples],
        finish_reasons=[s.finish_reason for s in samples],
        min_version=min(versions, default=group.start_version),
        max_version=max(versions, default=group.start_version),
        generate_s=group.generate_s, reward_s=group.reward_s, created_unix=time.time(),
        num_reward_failures=group.num_reward_failures, reward_means=group.reward_means,
        served=[group.served[v] for v in sorted(set(versions))],
        metrics={"num_turns": sum(s.turn + 1 for s in samples), "num_aborts": sum(s.num_aborts for s in samples),
                 "num_generated_tokens": sum(sum(s.loss_mask) for s in samples)})
    tensors = [
        ("prompt_ids", np.tile(np.asarray(group.prompt_ids, dtype=np.int32), len(samples))),
        ("completion_ids", np.asarray([t for s in samples for t in s.completion_ids], dtype=np.int32)),
        ("logprobs", np.asarray([x for s in samples for x in s.logprobs], dtype=np.float32)),
        ("versions", np.asarray(versions, dtype=np.int32)),
        ("loss_mask", np.asarray([m for s in samples for m in s.loss_mask], dtype=np.uint8)),
    ]
    return FinishedGroup(group=header, tensors=tensors)
