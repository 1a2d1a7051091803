"""Rollouts of leased prompt groups: samples advance chunk by chunk while environment turns run beside them.

:class:`Rollouts` holds every sample of every group the worker has leased; the worker loop calls :meth:`step`::

    ready samples --- backend.generate: <= chunk_tokens each, under the version the partial policy picks ---+
         ^                                                                                                 |
         | environment reply (loss mask 0)               turn over: EOS, a stop string or max_new_tokens   |
         +------- environment step, one guarded thread per sample <----------------------------------------+
                                  | done + reward (failures: reward 0, counted)
                                  v
                  every sample of a group done -> TRL-style rewards, if any: one guarded call per function
                                                  (rewards/group.py) -> FinishedGroup (header + 5 tensors)

A streaming backend (``backend.streaming``: vllm) is fed continuously: each ready sample's turn goes into the
running engine as one request (its whole budget: ``worker.max_new_tokens``, the context), and each :meth:`step`
submits what became ready, takes one engine step's new tokens (the engine core keeps stepping meanwhile) and
ends the turns that ended. New leases and samples back from their environment join the running batch; a sample
is split only where an adapter swap requires it. Other backends (hf, sim) run rounds instead: one round
generates one chunk (``worker.chunk_tokens``) for every ready sample of every group at once. Either way samples
of different lengths and groups leased at different times share batches, and a slow environment step holds up
only its own sample.

Versions and partial rollouts. ``current_version`` is the newest adapter the backend holds (read from the
backend, which owns it). Every generated token records the version that produced it; environment tokens record
the current version when they are appended (never older than the sample's own tokens, so they never make a
group look staler). When a new version arrives while a sample is under way, ``worker.partial_policy`` decides
at the sample's next chunk boundary, or, streaming, at the first step after the load (the sample's request is
aborted at the tokens it has and resubmitted: ``requests_moved``, their tokens ``tokens_moved``; the shortest
prefixes first, the others once the new version's first token is out, so the step that makes it is short):

- ``finish``: the sample keeps the version of its first token to the end (that version stays resident:
  :meth:`versions_in_use`);
- ``continue``: later tokens use the new version; the prefix is kept and re-read by the new adapter, so one
  sample may span versions;
- ``abort``: the sample's tokens are dropped and it starts again from the prompt under the new version
  (counter ``samples_aborted``); samples already done are kept. After ``worker.max_aborts`` restarts a sample
  continues at later swaps instead (counter ``abort_limit_reached``): when adapters arrive faster than a sample completes,
  aborting forever would never finish it.

Under ``continue`` and ``abort``, a turn with at most ``worker.finish_within_tokens`` tokens left of its budget
(:meth:`_budget`) when the new version arrives finishes under the version of its last token instead, while the
backend still holds it (counter ``kept_near_turn_end``: streamed requests per swap, chunks otherwise): re-reading a long prefix to make a few more tokens is
the most expensive part of a swap (every token of the prefix for those few), and those few tokens are one version
staler, which the staleness rule and the learner's per-token mask already account for. The next turn of a
multi-turn sample starts under the newest version.

A group's ``min_version`` is the oldest version of any of its tokens, ``max_version`` the newest: the staleness
rule keeps a group while its newest token is within ``max_staleness`` and the learner masks the older tokens
(:mod:`common.versions`), so a long ``continue`` sample is not dropped for having started early.

Evidence. A group keeps, per version of its tokens, what the engine served that version with
(:class:`common.protocol.ServedAdapter`): for generated tokens the backend's report of the very request
(``GenOutput.served``), for environment tokens ``backend.served`` of the current version. The RolloutGroup's
``served`` lists exactly the distinct versions of its ``versions`` tensor (checked by the learner,
:mod:`common.integrity`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.chat import Message, is_conversational
from common.config import WorkerConfig
from common.logging import get_logger
from common.metrics import Metrics
from common.protocol import PromptLease, RolloutGroup, ServedAdapter
from rollout_worker.backends.base import Backend, GenRequest
from rollout_worker.envs import Environment, EnvResolver, Episode, Step
from rollout_worker.rewards import (
    Attributed,
    GuardedCall,
    InvalidReward,
    RewardFn,
    RewardSet,
    as_reward,
    call_guarded,
)
from rollout_worker.rewards.group import GroupScore, GroupScoring, inputs_for

log = get_logger("rollout")

READY, GENERATING, IN_ENV, DONE = "ready", "generating", "env", "done"

#: tokens the engine may re-read after an adapter swap before the new version's first token (streaming): about one
#: decode step's worth, so the step that makes it is short; the other moved samples wait for that token (the engine
#: core schedules a step or two ahead: submitted at once, they would share that step)
SWAP_FIRST_STEP_TOKENS = 64


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


def first_after_swap(ready: Sequence[tuple[GroupRollout, Sample]]) -> int:
    """How many of the ``ready`` samples (shortest first) go into the engine in the step after a swap: the shortest,
    and the next ones while their tokens stay within SWAP_FIRST_STEP_TOKENS."""
    total = 0
    for count, (group, sample) in enumerate(ready):
        total += len(group.prompt_ids) + len(sample.completion_ids)
        if count and total > SWAP_FIRST_STEP_TOKENS:
            return count
    return len(ready)


class Rollouts:
    """The samples of every leased group, advanced one chunk round at a time (see the module docstring)."""

    def __init__(self, backend: Backend, envs: EnvResolver, config: WorkerConfig, *, worker_id: str,
                 max_seq_len: int, metrics: Metrics | None = None, reward_fn: RewardFn | None = None,
                 rewards: RewardSet | None = None, wake: threading.Event | None = None, greedy: bool = False) -> None:
        """``rewards``: worker.reward(s) resolved (:func:`rollout_worker.rewards.load_rewards`); ``reward_fn``
        alone is a per-sample reward (loraflow's signature)."""
        self.backend = backend
        self.envs = envs
        self.config = config
        self.worker_id = worker_id
        self.max_seq_len = max_seq_len
        self.metrics = metrics or Metrics()
        self.rewards = rewards or RewardSet(per_sample=reward_fn, per_sample_name=getattr(reward_fn, "__name__", ""))
        self.reward_fn = self.rewards.per_sample
        self.wake = wake or threading.Event()
        self.greedy = greedy
        self.last_failure = ""  # what the newest failure of user code said (the worker's stop message names it)
        self.groups: dict[str, GroupRollout] = {}  # by lease id, in lease order
        self._streams: dict[str, tuple[GroupRollout, Sample]] = {}  # request id in the engine -> its sample
        self._num_requests = 0  # request ids handed out (each is used once)
        self._swap_first: set[str] = set()  # requests submitted first after a swap, none has a token yet
        self._kept_for = 0  # the newest version whose swap kept_near_turn_end has counted

    @property
    def current_version(self) -> int:
        return self.backend.newest_version

    # -- groups ------------------------------------------------------------------------------------------------

    def add(self, lease: PromptLease) -> None:
        """Start the group of a granted lease."""
        env = self.envs.for_task(lease.task)
        group = GroupRollout(lease=lease, env=env, prompt_ids=self.backend.encode(lease.prompt_value), samples=[],
                             start_version=self.current_version)
        for index in range(lease.group_size):
            episode = Episode(prompt=lease.prompt_value, answer=lease.answer, task=lease.task, meta=lease.meta,
                              group_id=lease.group_id, index=index, columns=lease.columns or {})
            sample = Sample(index=index, episode=episode)
            self._start_conversation(sample, lease.prompt_value)
            group.samples.append(sample)
            self._start_episode(group, sample)
        self.groups[lease.lease_id] = group

    def remove(self, lease_id: str) -> GroupRollout:
        """Stop a group (its lease is being returned); its requests leave the engine, its environment calls are
        abandoned."""
        group = self.groups.pop(lease_id)
        self._abort([s for s in group.samples if s.status == GENERATING])
        return group

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def has_ready(self) -> bool:
        """Whether a sample waits for the engine or is in it (then :meth:`step` generates)."""
        return bool(self._streams) or any(s.status == READY for g in self.groups.values() for s in g.samples)

    def next_deadline(self) -> float | None:
        """Monotonic time of the earliest environment-step or group-reward deadline, if any is in flight."""
        deadlines = [s.call.deadline for g in self.groups.values() for s in g.samples
                     if s.status == IN_ENV and s.call is not None]
        deadlines += [g.scoring.deadline for g in self.groups.values() if g.scoring is not None]
        return min(deadlines, default=None)

    def versions_in_use(self) -> set[int]:
        """Versions the backend must keep: those of requests in the engine, and those pinned by samples under way
        (``finish`` policy)."""
        streaming = {s.request_version for _, s in self._streams.values()}
        if self.config.partial_policy != "finish":  # and a turn that keeps its version between two chunks
            return streaming | {s.versions[-1] for g in self.groups.values() for s in g.samples
                                if s.status == READY and s.versions and self._keeps_version(g, s, s.versions[-1])}
        return streaming | {s.version for g in self.groups.values() for s in g.samples
                            if s.status != DONE and s.version is not None}

    # -- one round ---------------------------------------------------------------------------------------------

    def step(self) -> list[FinishedGroup]:
        """Collect finished environment steps, generate (one engine step of the stream, or one chunk for every
        ready sample), collect again."""
        self._collect()
        if self.backend.streaming:
            self._stream()
            self._collect()
        else:
            ready = [(g, s) for g in self.groups.values() for s in g.samples if s.status == READY]
            if ready:
                self._generate(ready)
                self._collect()
        return self._pop_finished()

    def poll(self) -> list[FinishedGroup]:
        """Collect finished environment steps without generating."""
        self._collect()
        return self._pop_finished()

    def _generate(self, ready: list[tuple[GroupRollout, Sample]]) -> None:
        chunk = self.config.chunk_tokens
        batch: list[tuple[GroupRollout, Sample, int]] = []
        requests = []
        for group, sample in ready:
            version = self._version_for(group, sample)
            budget = min(chunk, self._budget(group, sample))
            if budget <= 0:
                self._end_turn(group, sample, "length")
                continue
            batch.append((group, sample, version))
            requests.append(GenRequest(token_ids=group.prompt_ids + sample.completion_ids, max_tokens=budget,
                                       version=version, num_generated=sample.turn_tokens,
                                       key=f"{group.lease.group_id}/{sample.index}/{sample.num_aborts}/{sample.turn}"))
        if not requests:
            return
        started = time.monotonic()
        outputs = self.backend.generate(requests, greedy=self.greedy)
        elapsed_s = time.monotonic() - started
        for group in {id(g): g for g, _, _ in batch}.values():
            group.generate_s += elapsed_s
        num_tokens = 0
        for (group, sample, version), output in zip(batch, outputs, strict=True):
            if sample.version is None:
                sample.version = version
            assert output.served is not None  # Backend.generate fills it
            added, end = self._append(group, sample, version, output.token_ids, output.logprobs, output.finished,
                                      output.served)
            num_tokens += added
            if end:
                self._end_turn(group, sample, end)
        self.metrics.inc("tokens_generated", num_tokens)

    def _near_turn_end(self, group: GroupRollout, sample: Sample) -> bool:
        """A turn under way with at most worker.finish_within_tokens tokens left (it keeps its version)."""
        return sample.turn_tokens > 0 and 0 < self._budget(group, sample) <= self.config.finish_within_tokens

    def _keeps_version(self, group: GroupRollout, sample: Sample, version: int) -> bool:
        """Whether a turn under way that runs under ``version`` keeps it although a newer one arrived (continue
        and abort policies): near its end (worker.finish_within_tokens), or ``version`` within
        worker.keep_version_within of the newest. Only while the backend still holds ``version``."""
        if self.config.partial_policy == "finish" or sample.turn_tokens == 0 or not self.backend.has_version(version):
            return False
        return (self.current_version - version <= self.config.keep_version_within
                or self._near_turn_end(group, sample))

    def _budget(self, group: GroupRollout, sample: Sample) -> int:
        """Tokens the sample's turn may still generate (worker.max_new_tokens, the context)."""
        room = self.max_seq_len - len(group.prompt_ids) - len(sample.completion_ids)
        return min(self.config.max_new_tokens - sample.turn_tokens, room)

    def _append(self, group: GroupRollout, sample: Sample, version: int, token_ids: list[int],
                logprobs: list[float], eos: bool, served: ServedAdapter) -> tuple[int, str]:
        """Add generated tokens of ``version`` to the sample; returns how many it kept and how its turn ended
        ("": not yet): eos, stop_string (worker.stop_strings), stop (the environment's) or length."""
        start = len(sample.completion_ids)
        sample.append(token_ids, logprobs, version, trained=True)
        self.backend.keep_served(group.served, served)
        sample.turn_tokens += len(token_ids)
        end = ""
        if eos:
            end = "eos"
        elif self.config.stop_strings and self._cut_at_stop(self.config.stop_strings, sample, start):
            end = "stop_string"
        elif group.env.stop_strings and self._cut_at_stop(group.env.stop_strings, sample, start):
            end = "stop"
        elif self._budget(group, sample) <= 0:
            end = "length"
        return len(sample.completion_ids) - start, end

    # -- the stream (a backend whose engine is fed continuously) -----------------------------------------------

    def _stream(self) -> None:
        """Move samples whose version the partial policy changes, submit every ready sample's turn whole, and
        take one engine step's tokens (see the module docstring)."""
        newest = self.current_version
        moved, kept = [], 0
        for g, s in self._streams.values():
            if s.request_version == newest:
                continue
            if not self.backend.has_version(s.request_version):
                moved.append((g, s))
            elif self.config.partial_policy == "finish":
                continue
            elif self._keeps_version(g, s, s.request_version):
                kept += 1
            else:
                moved.append((g, s))
        if kept and self._kept_for != newest:  # counted once per sample and swap, not at every step after it
            self._kept_for = newest
            self.metrics.inc("turns_kept_version", kept)
        if moved:  # aborted at their current tokens; resubmitted below under the version _version_for picks
            self.metrics.inc("requests_moved", len(moved))
            # the tokens the new version re-reads (prefill) before its first token of each moved sample
            self.metrics.inc("tokens_moved", sum(len(g.prompt_ids) + len(s.completion_ids) for g, s in moved))
            self._abort([s for _, s in moved])
        ready = sorted(((g, s) for g in self.groups.values() for s in g.samples if s.status == READY),
                       key=lambda gs: len(gs[0].prompt_ids) + len(gs[1].completion_ids))
        if moved:  # after a swap only the shortest prefixes go in, until one of them has its first new token: the
            ready = ready[:first_after_swap(ready)]  # engine's next steps are short ones (see SWAP_FIRST_STEP_TOKENS)
            self._swap_first = set()
        elif self._swap_first & self._streams.keys():
            ready = []
        for group, sample in ready:  # shortest first: the engine's scheduler is first come, first served
            self._submit(group, sample)
            if moved:
                self._swap_first.add(sample.request_id)
        if not self._streams:
            return
        started = time.monotonic()
        deltas = self.backend.advance()
        elapsed_s = time.monotonic() - started
        for group in {id(g): g for g, _ in self._streams.values()}.values():
            group.generate_s += elapsed_s
        num_tokens = 0
        if self._swap_first and any(d.token_ids for d in deltas if d.request_id in self._swap_first):
            self._swap_first = set()  # the new version's first token is out: the held samples go in next step
        for delta in deltas:
            group, sample = self._streams[delta.request_id]
            if sample.version is None:
                sample.version = sample.request_version
            assert delta.served is not None  # Backend.advance fills it
            added, end = self._append(group, sample, sample.request_version, delta.token_ids, delta.logprobs,
                                      delta.finished, delta.served)
            num_tokens += added
            if delta.done:
                self._left_engine(sample)
                end = end or "length"  # the engine ended it short of the budget: its own limit (the context)
            elif end:  # a stop string: the engine would go on
                self._abort([sample])
            if end:
                self._end_turn(group, sample, end)
        self.metrics.inc("tokens_generated", num_tokens)

    def _submit(self, group: GroupRollout, sample: Sample) -> None:
        version = self._version_for(group, sample)
        if sample.status != READY:
            return  # the abort policy restarted the episode, and its environment's start failed
        budget = self._budget(group, sample)
        if budget <= 0:
            self._end_turn(group, sample, "length")
            return
        self._num_requests += 1
        request_id = f"{group.lease.group_id}/{sample.index}/{self._num_requests}"
        self.backend.submit(request_id, GenRequest(
            token_ids=group.prompt_ids + sample.completion_ids, max_tokens=budget, version=version,
            num_generated=sample.turn_tokens, key=f"{group.lease.group_id}/{sample.index}/{sample.num_aborts}/"
            f"{sample.turn}/{len(sample.completion_ids)}"), greedy=self.greedy)
        sample.status, sample.request_id, sample.request_version = GENERATING, request_id, version
        self._streams[request_id] = (group, sample)

    def _left_engine(self, sample: Sample) -> None:
        del self._streams[sample.request_id]
        sample.request_id = ""

    def _abort(self, samples: list[Sample]) -> None:
        """Take samples' requests out of the engine where they are; the samples are ready again."""
        self.backend.abort([s.request_id for s in samples])
        for sample in samples:
            self._left_engine(sample)
            sample.status = READY

    def _version_for(self, group: GroupRollout, sample: Sample) -> int:
        """The version that generates the sample's next chunk (the partial policy; see the module docstring)."""
        newest = self.current_version
        if sample.version is None or sample.version == newest:
            return newest
        policy = self.config.partial_policy
        if sample.versions and self._keeps_version(group, sample, sample.versions[-1]):
            if sample.versions[-1] != newest:
                self.metrics.inc("turns_kept_version")
            return sample.versions[-1]
        if policy == "finish":
            if self.backend.has_version(sample.version):
                return sample.version
            self.metrics.inc("pinned_version_lost")
            log.warning("pinned_version_lost", version=sample.version, newest=newest)
            return newest
        if policy == "abort" and sample.num_aborts >= self.config.max_aborts:
            self.metrics.inc("abort_limit_reached")  # once per swap continued past the limit
            return newest  # continue: the prefix is kept, later tokens carry the new version
        if policy == "abort":
            sample.truncate(0)
            sample.turn = sample.turn_start = sample.turn_tokens = 0
            sample.version = None
            sample.num_aborts += 1
            self.metrics.inc("samples_aborted")
            self._start_conversation(sample, group.lease.prompt_value)
            self._start_episode(group, sample)
        return newest

    def _cut_at_stop(self, stop_strings: Sequence[str], sample: Sample, chunk_start: int) -> bool:
        """End the turn right after a stop string that appeared in this chunk; True if one did."""
        # one ending in the new tokens starts in the last 4 tokens per character (a byte-level vocabulary) before
        # them: decode only that tail (a streamed turn is checked at every token)
        tail = sample.completion_ids[max(sample.turn_start, chunk_start - 4 * max(map(len, stop_strings)) - 8):]
        if not any(stop in self.backend.decode(tail) for stop in stop_strings):
            return False
        turn_ids = sample.completion_ids[sample.turn_start:]
        first = max(1, chunk_start - sample.turn_start)
        for length in range(first, len(turn_ids) + 1):  # the shortest prefix holding a stop string
            if any(stop in self.backend.decode(turn_ids[:length]) for stop in stop_strings):
                break
        sample.turn_tokens -= len(turn_ids) - length
        sample.truncate(sample.turn_start + length)
        return True

    # -- environment steps -------------------------------------------------------------------------------------

    def _start_conversation(self, sample: Sample, prompt: Any) -> None:
        """A conversational prompt on a backend with a tokenizer: tool replies join it through the template."""
        chat = self.backend.chat
        sample.messages = [dict(m) for m in prompt] if chat is not None and is_conversational(prompt) else None

    def _start_episode(self, group: GroupRollout, sample: Sample) -> None:
        sample.status = READY
        if type(group.env).start is Environment.start:
            return  # no per-episode state: nothing to run
        outcome = call_guarded(group.env.start, sample.episode, timeout_s=self.config.reward_timeout_s)
        if outcome.ok:
            sample.env_state = outcome.value
        else:
            self._fail(group, sample, outcome.failure, outcome.error)

    def _end_turn(self, group: GroupRollout, sample: Sample, end: str) -> None:
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

    def _collect(self) -> None:
        now = time.monotonic()
        for group in self.groups.values():
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
        sample.append(reply, [0.0] * len(reply), self.current_version, trained=False)
        self.backend.keep_served(group.served, self.backend.served(self.current_version))
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

    # -- finished groups ---------------------------------------------------------------------------------------

    def _pop_finished(self) -> list[FinishedGroup]:
        finished = [lease_id for lease_id, g in self.groups.items() if g.done and self._scored(g)]
        return [self._assemble(self.groups.pop(lease_id)) for lease_id in finished]

    def _scored(self, group: GroupRollout) -> bool:
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

    def _assemble(self, group: GroupRollout) -> FinishedGroup:
        samples = group.samples
        versions = [v for s in samples for v in s.versions]
        header = RolloutGroup(
            group_id=group.lease.group_id, lease_id=group.lease.lease_id, worker_id=self.worker_id,
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
