"""Rollouts: chunk rounds, partial-rollout policies, multi-turn environments, failing user code, group layout.

A scripted backend writes known text per (sample, turn), so every token, mask and version can be checked
exactly; the same scheduler runs over the real backends in test_backends.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from loraflow.common import codec, group_checks
from loraflow.common.config import WorkerConfig
from loraflow.common.metrics import Metrics
from loraflow.rollout_worker.adapters import ReceivedAdapter
from loraflow.rollout_worker.backends.base import Backend, GenOutput, GenRequest, Sampling
from loraflow.rollout_worker.envs import Environment, EnvResolver, Episode, Step
from loraflow.rollout_worker.rollout import Rollouts
from loraflow.rollout_worker.samples import DONE, IN_ENV, FinishedGroup
from tests.support import wait_for
from tests.worker.helpers import lease

EOS = 256
Script = Callable[[int, int], tuple[str, bool]]  # (sample index, turn) -> (text, then EOS?)


class ScriptedBackend(Backend):
    """Bytes as tokens (EOS = 256); sample i's turn t writes script(i, t); log-prob encodes the version."""

    name = "scripted"
    eos_token_id = EOS
    vocab_size = 257

    def __init__(self, script: Script) -> None:
        super().__init__(Sampling())
        self.script = script

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def encode_continuation(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode()

    def _load(self, adapter: ReceivedAdapter) -> None:
        pass

    def _unload(self, version: int) -> None:
        pass

    def _generate(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]:
        outputs = []
        for r in requests:
            _, sample, _, turn = r.key.rsplit("/", 3)
            text, eos = self.script(int(sample), int(turn))
            tokens = list(text.encode()) + ([EOS] if eos else list(b"~" * 1000))
            ids = tokens[r.num_generated:r.num_generated + r.max_tokens]
            outputs.append(GenOutput(token_ids=ids, logprobs=[-0.1 * (r.version + 1)] * len(ids),
                                     finished=ids[-1] == EOS))
        return outputs


def serve_version(backend: Backend, version: int) -> None:
    backend.add_adapter(ReceivedAdapter(version=version, sha256=f"sha-{version}", path=Path("."), config={"r": 8},
                                        num_bytes=0, received_unix=0.0))


def make_rollouts(backend: Backend, env: Environment | None = None, *, reward_fn: Any = None,
                  max_seq_len: int = 512, **config: Any) -> Rollouts:
    worker = WorkerConfig(**{"chunk_tokens": 4, "max_new_tokens": 32, "reward_timeout_s": 5.0, **config})
    return Rollouts(backend, EnvResolver(env or ""), worker, worker_id="w1", max_seq_len=max_seq_len,
                    metrics=Metrics(), reward_fn=reward_fn)


def run_to_end(rollouts: Rollouts, timeout_s: float = 10.0) -> list[FinishedGroup]:
    finished: list[FinishedGroup] = []

    def advance() -> bool:
        finished.extend(rollouts.step())
        return not rollouts.num_groups

    wait_for(advance, timeout_s, "the groups to finish", interval_s=0.005)
    return finished


def samples(finished: FinishedGroup) -> list[dict[str, list]]:
    """Per-sample token lists of a finished group, split by completion_lens."""
    arrays = dict(finished.tensors)
    out, start = [], 0
    for length in finished.group.completion_lens:
        out.append({name: arrays[name][start:start + length].tolist()
                    for name in ("completion_ids", "logprobs", "versions", "loss_mask")})
        start += length
    return out


def test_single_turn_group_has_the_wire_layout_and_scores() -> None:
    backend = ScriptedBackend(lambda i, t: ("46" if i == 0 else "47", True))
    rollouts = make_rollouts(backend)
    rollouts.add(lease(group_size=3))
    (finished,) = run_to_end(rollouts)
    group = finished.group
    assert group.rewards == [1.0, 0.0, 0.0] and group.finish_reasons == ["stop"] * 3
    assert group.prompt_lens == [6] * 3 and group.completion_lens == [3] * 3
    assert (group.min_version, group.max_version, group.group_id, group.worker_id) == (0, 0, "0:0", "w1")
    frames = codec.encode(group, finished.tensors)
    record, envelope = codec.decode([bytes(f) for f in frames])  # the layout the broker checks
    group_checks.check_group_values(record, envelope.specs, envelope.frames, vocab_size=257, latest_version=0)
    assert samples(finished)[0] == {"completion_ids": [52, 54, EOS], "logprobs": pytest.approx([-0.1] * 3),
                                    "versions": [0, 0, 0], "loss_mask": [1, 1, 1]}


def test_calculator_episode_env_tokens_are_masked_with_zero_logprob() -> None:
    script = {0: ("<calc>2*3+1</calc>zz", False), 1: ("7", True)}
    rollouts = make_rollouts(ScriptedBackend(lambda i, t: script[t]), chunk_tokens=8)
    rollouts.add(lease(task="calculator", prompt="2*3+1=", answer="7", group_size=1))
    (finished,) = run_to_end(rollouts)
    (sample,) = samples(finished)
    call, reply, answer = list(b"<calc>2*3+1</calc>"), list(b"=7"), list(b"7") + [EOS]
    assert sample["completion_ids"] == call + reply + answer  # the turn was cut right after the stop string
    assert sample["loss_mask"] == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
    assert sample["logprobs"][len(call):len(call) + 2] == [0.0, 0.0]
    assert finished.group.rewards == [1.0] and finished.group.metrics["num_turns"] == 2


def test_a_slow_environment_step_holds_up_only_its_own_sample() -> None:
    release = threading.Event()

    class SlowFirstSample(Environment):
        stop_strings = ("</calc>",)
        max_turns = 3

        def step(self, state: Any, turn: str, *, finished: bool, episode: Episode) -> Step:
            if episode.index == 0 and not release.wait(30):
                raise TimeoutError("never released")
            return Step(done=False, reply="=1") if not finished else Step(done=True, reward=1.0)

    backend = ScriptedBackend(lambda i, t: ("<calc>1</calc>", False) if t < 2 else ("1", True))
    rollouts = make_rollouts(backend, SlowFirstSample())
    rollouts.add(lease(group_size=3))
    group = rollouts.groups["lease-0:0"]
    wait_for(lambda: rollouts.step() or all(s.status == DONE for s in group.samples[1:]), 10,
             "samples 1 and 2 to finish all their turns", interval_s=0.005)
    assert group.samples[0].status == IN_ENV and group.samples[0].turn == 0
    assert [s.turn for s in group.samples[1:]] == [2, 2]
    release.set()
    (finished,) = run_to_end(rollouts)
    assert finished.group.rewards == [1.0, 1.0, 1.0]


def reward_by_text(completion: str, answer: str, **info: Any) -> float:
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "nan":
        return float("nan")
    if completion == "hang":
        threading.Event().wait(60)
    return 0.75


def test_raising_nan_and_hanging_rewards_score_zero_and_are_counted() -> None:
    texts = ["raise", "nan", "hang", "fine"]
    rollouts = make_rollouts(ScriptedBackend(lambda i, t: (texts[i], True)), reward_timeout_s=0.3,
                             reward_fn=reward_by_text)
    rollouts.add(lease(group_size=4))
    started = time.monotonic()
    (finished,) = run_to_end(rollouts)
    assert time.monotonic() - started < 5
    assert finished.group.rewards == [0.0, 0.0, 0.0, 0.75]
    assert finished.group.finish_reasons == ["error", "error", "error", "stop"]
    assert finished.group.num_reward_failures == 3
    for reason in ("exception", "nan", "timeout"):
        assert rollouts.metrics.counter("reward_failures", reason=reason) == 1
    rollouts.add(lease("0:1", group_size=1))  # the worker keeps going
    (after,) = run_to_end(rollouts)
    assert after.group.rewards == [0.0] and after.group.finish_reasons == ["error"]  # "raise" again


def test_broken_environments_fail_closed() -> None:
    class Broken(Environment):
        def start(self, episode: Episode) -> Any:
            if episode.index == 0:
                raise ValueError("cannot start")
            return None

        def step(self, state: Any, turn: str, *, finished: bool, episode: Episode) -> Any:
            return {"reward": 1} if episode.index == 1 else Step(done=True, reward=float("inf"))

    rollouts = make_rollouts(ScriptedBackend(lambda i, t: ("x", True)), Broken())
    rollouts.add(lease(group_size=3))
    (finished,) = run_to_end(rollouts)
    assert finished.group.rewards == [0.0, 0.0, 0.0] and finished.group.num_reward_failures == 3
    assert finished.group.completion_lens[0] == 0  # never started
    assert rollouts.metrics.counter("reward_failures", reason="type") == 1
    assert rollouts.metrics.counter("reward_failures", reason="nan") == 1


def test_turn_limit_and_context_limit() -> None:
    rollouts = make_rollouts(ScriptedBackend(lambda i, t: ("<calc>1</calc>", False)), max_turns=2)
    rollouts.add(lease(task="calculator", group_size=1))
    (finished,) = run_to_end(rollouts)
    assert finished.group.finish_reasons == ["turn_limit"] and finished.group.rewards == [0.0]
    assert samples(finished)[0]["loss_mask"] == [1] * 14 + [0] * 2 + [1] * 14

    rollouts = make_rollouts(ScriptedBackend(lambda i, t: ("46", False)), max_seq_len=10)
    rollouts.add(lease(group_size=1))
    (finished,) = run_to_end(rollouts)
    assert finished.group.completion_lens == [4] and finished.group.finish_reasons == ["length"]


def swap_mid_generation(policy: str) -> tuple[Rollouts, FinishedGroup, FinishedGroup]:
    """Group A starts under v0; after its first chunk v1 arrives and group B is leased."""
    backend = ScriptedBackend(lambda i, t: ("a" * 10, True))
    rollouts = make_rollouts(backend, partial_policy=policy)
    rollouts.add(lease("0:0", group_size=2))
    assert rollouts.step() == []
    serve_version(backend, 1)  # the rollouts follow the backend's newest version
    rollouts.add(lease("0:1", group_size=1))
    if policy == "finish":
        assert rollouts.versions_in_use() == {0}
    first, second = sorted(run_to_end(rollouts), key=lambda f: f.group.group_id)
    return rollouts, first, second


def test_continue_swaps_at_the_chunk_boundary_and_keeps_the_prefix() -> None:
    _, first, second = swap_mid_generation("continue")
    assert [s["versions"] for s in samples(first)] == [[0] * 4 + [1] * 7] * 2
    assert samples(first)[0]["logprobs"] == pytest.approx([-0.1] * 4 + [-0.2] * 7)
    assert (first.group.min_version, first.group.max_version) == (0, 1)
    assert samples(second)[0]["versions"] == [1] * 11


def test_finish_keeps_the_old_version_to_the_end() -> None:
    rollouts, first, second = swap_mid_generation("finish")
    assert [s["versions"] for s in samples(first)] == [[0] * 11] * 2
    assert (first.group.min_version, first.group.max_version) == (0, 0)
    assert samples(second)[0]["versions"] == [1] * 11
    assert rollouts.versions_in_use() == set()


@pytest.mark.parametrize(("policy", "finish_within", "versions"), [
    ("continue", 8, [0] * 11),            # 8 tokens left of 12 after the first chunk: the turn ends under v0
    ("continue", 7, [0] * 4 + [1] * 7),   # 8 left > 7: the prefix is re-read under v1
    ("abort", 8, [0] * 11),               # kept, not restarted
])
def test_a_turn_near_its_end_finishes_under_its_version(policy: str, finish_within: int,
                                                        versions: list[int]) -> None:
    backend = ScriptedBackend(lambda i, t: ("a" * 10, True))
    rollouts = make_rollouts(backend, partial_policy=policy, max_new_tokens=12, finish_within_tokens=finish_within)
    rollouts.add(lease("0:0", group_size=2))
    assert rollouts.step() == []
    serve_version(backend, 1)
    rollouts.add(lease("0:1", group_size=1))
    kept = versions[-1] == 0
    assert rollouts.versions_in_use() == ({0} if kept else set())  # the backend must keep v0 for them
    first, second = sorted(run_to_end(rollouts), key=lambda f: f.group.group_id)
    assert [s["versions"] for s in samples(first)] == [versions] * 2
    assert samples(first)[0]["completion_ids"] == list(b"a" * 10) + [EOS]
    assert samples(second)[0]["versions"] == [1] * 11  # a new turn starts under the newest version
    assert rollouts.metrics.counter("turns_kept_version") == (4 if kept else 0)  # 2 samples x 2 chunks
    assert rollouts.metrics.counter("samples_aborted") == 0 and rollouts.versions_in_use() == set()


@pytest.mark.parametrize("policy", ["continue", "abort"])
def test_a_turn_keeps_its_version_while_within_keep_version_within(policy: str) -> None:
    """worker.keep_version_within = 1: v1 arriving after the first chunk leaves the turn on v0; v2 (two ahead)
    moves it (continue: its prefix re-read under v2; abort: it restarts)."""
    backend = ScriptedBackend(lambda i, t: ("a" * 10, True))
    rollouts = make_rollouts(backend, partial_policy=policy, keep_version_within=1)
    rollouts.add(lease("0:0", group_size=2))
    assert rollouts.step() == []
    serve_version(backend, 1)
    rollouts.add(lease("0:1", group_size=1))
    assert rollouts.versions_in_use() == {0}  # the backend must keep v0 for the turns on it
    assert rollouts.step() == []  # the second chunk: v0 for the first group, v1 for the new one
    serve_version(backend, 2)
    assert rollouts.versions_in_use() == {1}  # v0 is two behind now: those turns move; the new group keeps v1
    first, second = sorted(run_to_end(rollouts), key=lambda f: f.group.group_id)
    moved = [0] * 8 + [2] * 3 if policy == "continue" else [2] * 11
    assert [s["versions"] for s in samples(first)] == [moved] * 2
    assert samples(first)[0]["completion_ids"] == list(b"a" * 10) + [EOS]
    assert samples(second)[0]["versions"] == [1] * 11  # v1's turn stayed on v1: one behind v2
    assert rollouts.metrics.counter("turns_kept_version") == 2 + 2
    assert rollouts.metrics.counter("samples_aborted") == (2 if policy == "abort" else 0)


def test_abort_gives_up_after_max_aborts_so_a_sample_always_finishes() -> None:
    backend = ScriptedBackend(lambda i, t: ("a" * 10, True))
    rollouts = make_rollouts(backend, partial_policy="abort", max_aborts=2)
    rollouts.add(lease("0:0", group_size=1))
    finished: list[FinishedGroup] = []
    for version in range(1, 20):  # a new adapter after every chunk: sooner than any sample completes
        finished += rollouts.step()
        if finished:
            break
        serve_version(backend, version)
    (done,) = finished
    assert done.group.metrics["num_aborts"] == 2 and rollouts.metrics.counter("samples_aborted") == 2
    assert rollouts.metrics.counter("abort_limit_reached") >= 1
    versions = samples(done)[0]["versions"]
    assert versions[0] == 2 and versions[-1] > 2  # restarted twice, then continued across versions
    assert samples(done)[0]["completion_ids"] == list(b"a" * 10) + [EOS]


def test_abort_restarts_the_sample_under_the_new_version() -> None:
    rollouts, first, second = swap_mid_generation("abort")
    assert [s["versions"] for s in samples(first)] == [[1] * 11] * 2
    assert [s["completion_ids"] for s in samples(first)] == [list(b"a" * 10) + [EOS]] * 2
    assert first.group.metrics["num_aborts"] == 2 and rollouts.metrics.counter("samples_aborted") == 2
    assert (first.group.min_version, second.group.min_version) == (1, 1)
