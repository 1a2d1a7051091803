"""Agent episodes: each leased group's ``group_size`` episodes run a harness against their own gateway sessions.

``worker.agent = "package.module:run_episode"``: ``async def run_episode(client, row) -> float | dict`` gets an
``openai.AsyncOpenAI`` client whose base URL is its session (``<gateway>/sessions/<id>/v1``) and the dataset row
(every column, the prompt under ``prompt`` and under ``data.prompt_column``), and returns the reward, or
``{"reward": float, **numeric metrics}`` (the metrics' group means go into the group's metrics as
``agent_<name>``). A harness may instead end its episode with ``POST /sessions/<id>/finish`` and return None.

``worker.agent = "external"``: a harness in another process (any language) takes episodes with
``POST /sessions/claim`` and finishes each with ``POST /sessions/<id>/finish`` ``{"reward": float}``.

:class:`AgentRollouts` stands in for :class:`loraflow.rollout_worker.rollout.Rollouts` in the worker loop (the same
methods: add, remove, step, poll, has_ready, next_deadline, versions_in_use): the loop stays the engine's only
caller, taking one engine step (vllm: calls stream through the running engine) or one chunk round (hf) for
every call in flight whenever there is one (engine.py).

Every episode runs in a guarded thread of its own with its own event loop (rewards/guard.py), so a harness
that raises, blocks, or hangs past ``worker.agent_timeout_s`` costs only its own episode: it scores 0, is counted
(``agent_failures{reason}`` and ``reward_failures{reason}``) and logged, and its session is closed (later
calls get ``session_finished``). An episode that never called the model scores 0 too (reason ``no_calls``).
A group is submitted when all its episodes are done; its samples are the sessions' trajectories, each with its
own prompt (the first call's prompt tokens). Its ``served`` evidence (:mod:`loraflow.common.integrity`) is built as the
worker's own path builds it (:mod:`loraflow.rollout_worker.samples`): for generated tokens the backend's report of the very
engine calls that produced them (``GenOutput.served``, also kept per call in the session's records), for context
tokens ``backend.served`` of the version they were stamped with. The engine keeps each report, when it comes, in
the group's evidence (one dict shared by the group's sessions) with ``Backend.keep_served``, so a report that
disagrees with the load record stays the group's evidence and the learner's check (:mod:`loraflow.learner.integrity`)
fails the group.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loraflow.common.config import Config, ConfigError
from loraflow.common.logging import get_logger
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import PromptLease, RolloutGroup, ServedAdapter
from loraflow.rollout_worker.backends.base import Backend
from loraflow.rollout_worker.gateway.engine import GatewayEngine
from loraflow.rollout_worker.gateway.server import GatewayServer
from loraflow.rollout_worker.gateway.session import Session
from loraflow.rollout_worker.plugins import load_object
from loraflow.rollout_worker.rewards import GuardedCall, InvalidReward, as_reward
from loraflow.rollout_worker.samples import FinishedGroup

log = get_logger("gateway")

EXTERNAL = "external"


def episode_metrics(values: Any) -> dict[str, float]:
    """The metrics a harness reported that can travel in a RolloutGroup: string names, finite numbers (the broker
    refuses a whole group over one NaN, so a harness's NaN or inf is left out here, not sent)."""
    if not isinstance(values, dict):
        return {}
    return {k: float(v) for k, v in values.items() if isinstance(k, str) and isinstance(v, int | float)
            and not isinstance(v, bool) and math.isfinite(v)}


@dataclass(slots=True, kw_only=True)
class AgentEpisode:
    session: Session
    row: dict[str, Any]
    call: GuardedCall | None = None  # the harness in flight (in-process agents)
    deadline: float | None = None  # external agents: set when claimed
    done: bool = False
    reward: float = 0.0
    finished_reward: float | None = None  # given by POST .../finish
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str = ""


@dataclass(slots=True, kw_only=True)
class AgentGroup:
    lease: PromptLease
    episodes: list[AgentEpisode]
    start_version: int
    generate_s: float = 0.0
    reward_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    num_reward_failures: int = 0
    served: dict[int, ServedAdapter] = field(default_factory=dict)  # version -> the engine's evidence (shared)


def load_agent(spec: str) -> Any:
    fn = load_object(spec, "worker.agent")
    if not asyncio.iscoroutinefunction(fn):
        raise ConfigError(f"worker.agent = {spec!r} must be an async function run_episode(client, row) -> "
                          "float | dict")
    return fn


def parse_bind(bind: str) -> tuple[str, int]:
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"worker.gateway_bind = {bind!r} must be HOST:PORT (PORT 0 = any free port)")
    return host.strip("[]"), int(port)


class AgentRollouts:
    """Leased groups played by an agent harness through the gateway (see the module docstring)."""

    def __init__(self, config: Config, backend: Backend, *, worker_id: str, metrics: Metrics,
                 wake: threading.Event, info_path: Path | None = None) -> None:
        worker = config.worker
        self.config = config
        self.backend = backend
        self.worker_id = worker_id
        self.metrics = metrics
        self.wake = wake
        self.max_seq_len = config.model.max_seq_len
        self.agent = None if worker.agent == EXTERNAL else load_agent(worker.agent)
        self.token = secrets.token_urlsafe(32) if config.security.enabled else ""
        models = list(dict.fromkeys([Path(config.model.path).name or config.model.path, "loraflow"]))
        self.engine = GatewayEngine(backend, worker, max_seq_len=self.max_seq_len, models=models, metrics=metrics,
                                    wake=wake)
        self.engine.on_finish = self._finish_external
        self.engine.on_claim = self._claim
        host, port = parse_bind(worker.gateway_bind)
        self.server = GatewayServer(self.engine, host=host, port=port, max_request_bytes=worker.gateway_max_request_bytes,
                                    token=self.token, metrics=metrics).start()
        self.groups: dict[str, AgentGroup] = {}
        self.unclaimed: deque[AgentEpisode] = deque()
        self.last_failure = ""
        if info_path is not None:
            self._write_info(info_path)
        log.info("gateway_ready", url=self.server.url, agent=worker.agent, models=models,
                 token_required=bool(self.token))

    def _write_info(self, path: Path) -> None:
        """Where external harnesses find the gateway (and its token): a file only this user can read."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.server.url, "token": self.token, "models": self.engine.models}, f)

    @property
    def current_version(self) -> int:
        return self.backend.newest_version

    def close(self) -> None:
        self.engine.fail_all("the worker is stopping")
        self.server.close()

    # -- groups ------------------------------------------------------------------------------------------------

    def add(self, lease: PromptLease) -> None:
        group = AgentGroup(lease=lease, episodes=[], start_version=self.current_version)
        row = self._row(lease)
        for index in range(lease.group_size):
            session = Session(id=secrets.token_hex(12), group_key=lease.lease_id, index=index,
                              served=group.served)  # the engine keeps each report in the group's evidence
            self.engine.open(session)
            episode = AgentEpisode(session=session, row=dict(row))
            if self.agent is None:
                self.unclaimed.append(episode)
            else:
                episode.call = GuardedCall(self._run, self._base_url(session), episode.row,
                                           timeout_s=self.config.worker.agent_timeout_s, on_done=self.wake.set)
            group.episodes.append(episode)
        self.groups[lease.lease_id] = group

    def _row(self, lease: PromptLease) -> dict[str, Any]:
        data = self.config.data
        row = dict(lease.columns or {})
        row.update({"prompt": lease.prompt_value, data.prompt_column: lease.prompt_value, "answer": lease.answer,
                    "task": lease.task})
        if data.answer_column:
            row[data.answer_column] = lease.answer
        return row

    def _base_url(self, session: Session) -> str:
        return f"{self.server.url}/sessions/{session.id}/v1"

    def remove(self, lease_id: str) -> AgentGroup:
        group = self.groups.pop(lease_id)
        for episode in group.episodes:
            self.engine.close(episode.session.id)
            if episode in self.unclaimed:
                self.unclaimed.remove(episode)
        return group

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def has_ready(self) -> bool:
        return self.engine.has_work()

    def next_deadline(self) -> float | None:
        deadlines = [e.call.deadline if e.call is not None else e.deadline for g in self.groups.values()
                     for e in g.episodes if not e.done]
        return min((d for d in deadlines if d is not None), default=None)

    def versions_in_use(self) -> set[int]:
        return self.engine.versions_in_use()

    # -- one round ---------------------------------------------------------------------------------------------

    def step(self) -> list[FinishedGroup]:
        self.engine.pump(gather=True)
        busy = {c.session.group_key for c in self.engine.calls}
        started = time.monotonic()
        self.engine.round()
        elapsed_s = time.monotonic() - started
        for key in busy:
            if key in self.groups:
                self.groups[key].generate_s += elapsed_s
        self.engine.pump()
        return self._pop_finished()

    def poll(self) -> list[FinishedGroup]:
        self.engine.pump()
        return self._pop_finished()

    # -- episodes ----------------------------------------------------------------------------------------------

    def _run(self, base_url: str, row: dict[str, Any]) -> Any:
        """The harness, in its guarded thread with an event loop of its own."""
        import openai

        async def main() -> Any:
            # openai's aiohttp transport: ~30 % less client CPU a call than its httpx default (1.1 vs 1.6 ms,
            # BENCHMARKS.md "Agent gateway"), and 0.4 ms to build against 3 ms; the CPU is the engine's on a
            # CPU host. Plain HTTP (the gateway serves no TLS): without verify=False every client loads the CA
            # store, ~22 ms of CPU per episode under the worker's GIL
            http = openai.DefaultAioHttpClient(verify=False)
            async with openai.AsyncOpenAI(base_url=base_url, api_key=self.token or "loraflow", max_retries=0,
                                          timeout=self.config.worker.agent_timeout_s, http_client=http) as client:
                return await self.agent(client, row)

        return asyncio.run(main())

    def _claim(self) -> dict[str, Any] | None:
        if not self.unclaimed:
            return None
        episode = self.unclaimed.popleft()
        episode.deadline = time.monotonic() + self.config.worker.agent_timeout_s
        return {"session_id": episode.session.id, "base_url": self._base_url(episode.session), "row": episode.row}

    def _finish_external(self, session: Session, body: dict[str, Any]) -> str | None:
        episode = self._episode(session)
        if episode is None:
            return "this session belongs to no episode"
        try:
            reward = as_reward(body.get("reward"))
        except InvalidReward as exc:
            return f"'reward' must be a finite number: {exc}"
        metrics = body.get("metrics") or {}
        episode.finished_reward = reward
        episode.metrics = episode_metrics(metrics)
        self.engine.close(session.id)
        if self.agent is None:
            self._done(episode, reward)
        return None

    def _episode(self, session: Session) -> AgentEpisode | None:
        group = self.groups.get(session.group_key)
        return group.episodes[session.index] if group is not None else None

    def _collect(self, group: AgentGroup, now: float) -> None:
        for episode in group.episodes:
            if episode.done:
                continue
            if episode.call is not None:
                outcome = episode.call.poll(now)
                if outcome is None:
                    continue
                group.reward_s += outcome.duration_s
                if not outcome.ok:
                    error = outcome.error if outcome.failure != "timeout" else \
                        f"no result within {self.config.worker.agent_timeout_s:g} s (worker.agent_timeout_s)"
                    self._fail(group, episode, outcome.failure, error)
                    continue
                self._result(group, episode, outcome.value)
            elif episode.deadline is not None and now >= episode.deadline:
                self._fail(group, episode, "timeout", f"no finish within {self.config.worker.agent_timeout_s:g} s "
                           "(worker.agent_timeout_s)")

    def _result(self, group: AgentGroup, episode: AgentEpisode, value: Any) -> None:
        try:
            if value is None and episode.finished_reward is not None:
                value = episode.finished_reward
            metrics = {}
            if isinstance(value, dict):
                metrics = episode_metrics({k: v for k, v in value.items() if k != "reward"})
                value = value.get("reward")
            reward = as_reward(value)
        except InvalidReward as exc:
            self._fail(group, episode, exc.reason, str(exc))
            return
        if not episode.session.calls:
            self._fail(group, episode, "no_calls", "the harness returned without calling the model")
            return
        episode.metrics.update(metrics)
        self._done(episode, reward)

    def _done(self, episode: AgentEpisode, reward: float) -> None:
        episode.done, episode.reward = True, reward
        self.engine.close(episode.session.id)

    def _fail(self, group: AgentGroup, episode: AgentEpisode, reason: str, error: str) -> None:
        episode.done, episode.reward, episode.failure = True, 0.0, reason
        self.engine.close(episode.session.id)
        group.num_reward_failures += 1
        self.last_failure = f"{self.config.worker.agent}: {reason}: {error}"
        self.metrics.inc("agent_failures", reason=reason)
        self.metrics.inc("reward_failures", reason=reason)
        self.metrics.inc("reward_failures_by_function", function=self.config.worker.agent, reason=reason)
        log.warning("agent_failed", group_id=group.lease.group_id, sample=episode.session.index, reason=reason,
                    error=error[:300])

    def _pop_finished(self) -> list[FinishedGroup]:
        now = time.monotonic()
        finished = []
        for lease_id, group in list(self.groups.items()):
            self._collect(group, now)
            if all(e.done for e in group.episodes):
                finished.append(self._assemble(self.groups.pop(lease_id)))
        return finished

    def _assemble(self, group: AgentGroup) -> FinishedGroup:
        prompts, samples = [], []
        for episode in group.episodes:
            s = episode.session
            prompt = s.prompt_ids or self.backend.encode(group.lease.prompt_value)
            room = max(0, self.max_seq_len - len(prompt))  # context of a refused last call may run past it
            samples.append((s.completion_ids[:room], s.logprobs[:room], s.versions[:room], s.loss_mask[:room]))
            prompts.append(prompt[:self.max_seq_len])
        versions = [v for _, _, vs, _ in samples for v in vs]
        metrics: dict[str, Any] = {
            "num_turns": sum(len(e.session.calls) for e in group.episodes),
            "num_generated_tokens": sum(sum(m) for _, _, _, m in samples),
            "tito_divergence": sum(sum(e.session.divergences.values()) for e in group.episodes)}
        names = sorted({k for e in group.episodes for k in e.metrics})[:32]
        for name in names:
            values = [e.metrics[name] for e in group.episodes if name in e.metrics]
            metrics[f"agent_{name}"[:64]] = sum(values) / len(values)
        header = RolloutGroup(
            group_id=group.lease.group_id, lease_id=group.lease.lease_id, worker_id=self.worker_id,
            task=group.lease.task[:128], prompt_lens=[len(p) for p in prompts],
            completion_lens=[len(ids) for ids, _, _, _ in samples], rewards=[e.reward for e in group.episodes],
            finish_reasons=["error" if e.failure else ("length" if e.session.last_finish_reason == "length" else "stop")
                            for e in group.episodes],
            min_version=min(versions, default=group.start_version),
            max_version=max(versions, default=group.start_version),
            generate_s=group.generate_s, reward_s=group.reward_s, created_unix=time.time(),
            num_reward_failures=group.num_reward_failures, metrics=metrics,
            served=[group.served[v] for v in sorted(set(versions))])
        tensors = [
            ("prompt_ids", np.asarray([t for p in prompts for t in p], dtype=np.int32)),
            ("completion_ids", np.asarray([t for ids, _, _, _ in samples for t in ids], dtype=np.int32)),
            ("logprobs", np.asarray([x for _, lps, _, _ in samples for x in lps], dtype=np.float32)),
            ("versions", np.asarray(versions, dtype=np.int32)),
            ("loss_mask", np.asarray([m for _, _, _, ms in samples for m in ms], dtype=np.uint8)),
        ]
        return FinishedGroup(group=header, tensors=tensors)
