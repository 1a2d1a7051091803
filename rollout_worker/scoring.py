"""The user code of a rollout, each call guarded: an environment's start and its step after every model turn,
the per-sample reward (``worker.reward``), and a group's TRL-style rewards once every sample is done.

    model turn over -> end_turn: the turn's text to environment.step (and, when the episode is done, the
                       per-sample reward) in one guarded thread per sample; wake set when it returns
    collect         -> the step's reply continues the sample (loss mask 0, the current version), or its done +
                       reward ends it; the turn limit (env.max_turns, else worker.max_turns) ends it with reward 0
    scored          -> every sample done: the group's reward functions, one guarded call each (rewards/group.py);
                       their combined rewards replace the environment's

User code fails closed: a failure, a timeout (``worker.reward_timeout_s``) or a wrong type ends the sample (or
zeroes the group's scored samples) with reward 0, counted by reason and function and logged; ``last_failure``
says what the newest one said. Text is decoded here, never in the threads (no tokenizer use off this thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from loraflow.common.chat import is_conversational
from loraflow.common.config import WorkerConfig
from loraflow.common.logging import get_logger
from loraflow.common.metrics import Metrics
from loraflow.rollout_worker.backends.base import Backend
from loraflow.rollout_worker.envs import Environment, Episode, Step
from loraflow.rollout_worker.rewards import (
    Attributed,
    GuardedCall,
    InvalidReward,
    RewardSet,
    as_reward,
    call_guarded,
)
from loraflow.rollout_worker.rewards.group import GroupScore, GroupScoring, inputs_for
from loraflow.rollout_worker.samples import DONE, IN_ENV, READY, GroupRollout, Sample

log = get_logger("rollout")


class RolloutScoring:
    """The guarded user code of the worker's rollouts (see the module docstring)."""

    def __init__(self, backend: Backend, config: WorkerConfig, *, rewards: RewardSet, metrics: Metrics,
                 wake: threading.Event, max_seq_len: int) -> None:
        self.backend = backend
        self.config = config
        self.rewards = rewards
        self.reward_fn = rewards.per_sample
        self.metrics = metrics
        self.wake = wake
        self.max_seq_len = max_seq_len
        self.last_failure = ""  # what the newest failure of user code said (the worker's stop message names it)

    def start_conversation(self, sample: Sample, prompt: Any) -> None:
        """A conversational prompt on a backend with a tokenizer: tool replies join it through the template."""
        chat = self.backend.chat
        sample.messages = [dict(m) for m in prompt] if chat is not None and is_conversational(prompt) else None

    def start_episode(self, group: GroupRollout, sample: Sample) -> None:
        """The sample is ready, with its environment's per-episode state (a failed start ends it)."""
        sample.status = READY
        if type(group.env).start is Environment.start:
            return  # no per-episode state: nothing to run
        outcome = call_guarded(group.env.start, sample.episode, timeout_s=self.config.reward_timeout_s)
        if outcome.ok:
            sample.env_state = outcome.value
        else:
            self._fail(group, sample, outcome.failure, outcome.error)

    def end_turn(self, group: GroupRollout, sample: Sample, end: str) -> None:
        """Hand the finished model turn to the environment (text decoded here: no tokenizer use in threads)."""
        turn_ids = sample.completion_ids[sample.turn_start:]
        if end == "eos":
            turn_ids = turn_ids[:-1]
        text = self.backend.decode(turn_ids)
        if end == "stop_string":  # the text stops before the first stop string, as vLLM's does
            text = text[:min(i for i in (text.find(s) for s in self.config.stop_strings) if i >= 0)]
        completion = self.backend.decode(sample.completion_ids) if self.reward_fn is not None else ""
        sample.turn_end = end
        sample.turn_text = text
        sample.status = IN_ENV
        sample.call = GuardedCall(self._env_step, group.env, sample.env_state, sample.episode,
                                  text, end in ("eos", "stop_string"), completion,
                                  timeout_s=self.config.reward_timeout_s, on_done=self.wake.set)

    def _env_step(self, env: Environment, state: Any, episode: Episode, turn: str, finished: bool,
                  completion: str) -> Step:
        """Runs in the step's guarded thread: the environment's answer, and the reward override when done."""
        step = env.step(state, turn, finished=finished, episode=episode)
        if not isinstance(step, Step):
            raise InvalidReward(f"{type(env).__name__}.step returned {type(step).__name__}, not a Step", "type")
        if step.done:
            step.reward = as_reward(step.reward)
            if self.reward_fn is not None:
                try:
                    step.reward = as_reward(self.reward_fn(completion, episode.answer, prompt=episode.prompt,
                                                           task=episode.task, meta=episode.meta, finished=finished))
                except Exception as exc:  # noqa: BLE001 - re-raised, named, for the guard to count
                    raise Attributed(self.rewards.per_sample_name, exc) from exc
        return step

    def collect(self, groups: Iterable[GroupRollout]) -> None:
        """Take in the environment steps that returned (or timed out)."""
        now = time.monotonic()
        for group in groups:
            for sample in group.samples:
                if sample.status != IN_ENV or sample.call is None:
                    continue
                outcome = sample.call.poll(now)
                if outcome is None:
                    continue
                sample.call = None
                group.reward_s += outcome.duration_s
                if not outcome.ok:
                    self._fail(group, sample, outcome.failure, outcome.error,
                               outcome.function or self._step_owner(group))
                    continue
                self._apply_step(group, sample, outcome.value)

    def _apply_step(self, group: GroupRollout, sample: Sample, step: Step) -> None:
        if step.done:
            sample.status = DONE
            sample.reward = step.reward
            sample.finish_reason = "length" if sample.turn_end == "length" else "stop"
            return
        sample.turn += 1
        max_turns = group.env.max_turns or self.config.max_turns
        if sample.turn >= max_turns:
            sample.status, sample.reward, sample.finish_reason = DONE, 0.0, "turn_limit"
            return
        room = self.max_seq_len - len(group.prompt_ids) - len(sample.completion_ids)
        reply = self._reply_ids(group, sample, step.reply)[:max(0, room)]
        sample.append(reply, [0.0] * len(reply), self.backend.newest_version, trained=False)
        self.backend.keep_served(group.served, self.backend.served(self.backend.newest_version))
        sample.turn_start = len(sample.completion_ids)
        sample.turn_tokens = 0
        sample.status = READY

    def _reply_ids(self, group: GroupRollout, sample: Sample, reply: str) -> list[int]:
        """Tokens of an environment reply: a tool message through the chat template for a conversation (only
        the suffix after the held tokens; a re-rendered prefix that differs is counted), else the text as is."""
        chat = self.backend.chat
        if sample.messages is None or chat is None:
            return self.backend.encode_continuation(reply)
        appended = chat.append_turn(sample.messages, group.prompt_ids + sample.completion_ids, sample.turn_text,
                                    {"role": "tool", "content": reply})
        if appended.mismatch:
            self.metrics.inc("chat_prefix_mismatch", reason=appended.mismatch)
            log.debug("chat_prefix_mismatch", group_id=group.lease.group_id, sample=sample.index,
                      reason=appended.mismatch)
        return appended.token_ids

    def _step_owner(self, group: GroupRollout) -> str:
        """Who a timed-out environment step is charged to: worker.reward when set (it runs in the step's
        thread after the environment), else the environment."""
        return self.rewards.per_sample_name if self.reward_fn is not None else type(group.env).__name__

    def _fail(self, group: GroupRollout, sample: Sample, reason: str, error: str, function: str = "") -> None:
        """User code failed: the sample ends with reward 0, counted and logged."""
        function = function or type(group.env).__name__
        sample.status, sample.reward, sample.finish_reason = DONE, 0.0, "error"
        group.num_reward_failures += 1
        self.last_failure = f"{function}: {reason}: {error}"
        self.metrics.inc("reward_failures", reason=reason)
        self.metrics.inc("reward_failures_by_function", function=function, reason=reason)
        log.warning("reward_failed", group_id=group.lease.group_id, sample=sample.index, reason=reason,
                    function=function, error=error)

    # -- group rewards -----------------------------------------------------------------------------------------

    def scored(self, group: GroupRollout) -> bool:
        """Whether the group's TRL-style rewards are in; their calls start when its last sample is done."""
        if not self.rewards.batched:
            return True
        if group.scoring is None:
            inputs = inputs_for(group.lease.prompt_value, group.lease.columns or {},
                                [s.completion_ids for s in group.samples], self.backend.decode)
            group.scoring = GroupScoring(self.rewards.batched, inputs, timeout_s=self.config.reward_timeout_s,
                                         on_done=self.wake.set)
        score = group.scoring.result()
        if score is not None:
            self._apply_score(group, score)
        return score is not None

    def _apply_score(self, group: GroupRollout, score: GroupScore) -> None:
        """The combined rewards replace the environment's; a failed function zeroes the group (counted)."""
        group.reward_s += score.duration_s
        group.reward_means = score.means or None
        scored = [s for s in group.samples if s.finish_reason != "error"]  # failed steps keep their 0
        for sample in scored:
            sample.reward = score.rewards[sample.index]
            if score.failures:
                sample.finish_reason = "error"
        if score.failures:
            group.num_reward_failures += len(scored)
            self.metrics.inc("reward_failures", len(scored), reason=score.failures[0].reason)
        for failure in score.failures:
            self.last_failure = f"{failure.function}: {failure.reason}: {failure.error}"
            self.metrics.inc("reward_failures_by_function", len(scored), function=failure.function,
                             reason=failure.reason)
            log.warning("reward_failed", group_id=group.lease.group_id, function=failure.function,
                        reason=failure.reason, error=failure.error, num_samples=len(scored))
        if score.num_all_none:
            self.metrics.inc("rewards_all_none", score.num_all_none)

