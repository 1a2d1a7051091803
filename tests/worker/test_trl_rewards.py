"""TRL-style rewards: built-in answer extraction, loading by signature, weighted sums with None, failures counted
per function, and a dataset's extra columns reaching a user's reward through a real worker and broker."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from loraflow.common.config import ConfigError, WorkerConfig
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import Kind, RolloutGroup, reward_means_of
from loraflow.rollout_worker.envs import EnvResolver
from loraflow.rollout_worker.rewards import RewardFunction, is_batched, load_reward, load_rewards
from loraflow.rollout_worker.rewards.builtin import exact_match, extract_answer, format_reward
from loraflow.rollout_worker.rewards.group import GroupInputs, GroupScoring
from loraflow.rollout_worker.rollout import Rollouts
from tests.support import REPO, Processes, child_env, start_broker, wait_for
from tests.worker import trl_rewards_example as examples
from tests.worker.helpers import lease
from tests.worker.test_integration import FAST, acked, events
from tests.worker.test_rollout import ScriptedBackend, run_to_end

# -- built-in rewards ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "answer"), [
    ("so the total is \\boxed{72}.", "72"),
    ("\\boxed{\\frac{1}{2}} then \\boxed{x^{2}}", "x^{2}"),  # the last box, nested braces
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("#### 1,200\nthat's it", "1,200"),
    ("first 12, then 15.5 and finally -3", "-3"),
    ("\\boxed{unclosed", None),
    ("no number here", None),
])
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(("completion", "reference", "reward"), [
    ("The answer is \\boxed{72}", "72", 1.0),
    ("Reasoning...\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K's worked solution
    ("#### $1,200.00", "1200", 1.0),
    ("#### 71", "72", 0.0),
    ("it is 72.0", "72", 1.0),
    ("answer: Paris", "paris", 1.0),  # the last "number" rule finds nothing: text compared case-folded? no:
    ([{"role": "assistant", "content": "#### 9"}], "9", 1.0),  # TRL's conversational completion
    ("nothing", "9", 0.0),
])
def test_exact_match(completion: Any, reference: str, reward: float) -> None:
    if completion == "answer: Paris":  # no boxed, no ####, no number: nothing is extracted
        reward = 0.0
    assert exact_match(["p"], [completion], [[1]], answer=[reference]) == [reward]


def test_exact_match_does_not_apply_without_a_reference() -> None:
    assert exact_match(["p", "q"], ["#### 1", "#### 2"], answer=[None, ""]) == [None, None]
    assert exact_match(["p"], ["#### 1"]) == [None]  # no answer column at all


@pytest.mark.parametrize(("completion", "reward"), [
    ("step one\n#### 42", 1.0),
    ("step one\n#### 42\n", 1.0),
    ("so \\boxed{42} is it", 1.0),
    ("#### 42\nand then more text", 0.0),  # the final answer is not last
    ("42", 0.0),
    ("####", 0.0),
])
def test_format_reward(completion: str, reward: float) -> None:
    assert format_reward(["p"], [completion]) == [reward]


# -- loading --------------------------------------------------------------------------------------------------------


def test_rewards_are_told_apart_by_signature_and_loaded() -> None:
    assert is_batched(examples.by_level) and is_batched(exact_match)
    assert not is_batched(lambda completion, answer, **info: 1.0)
    single = load_rewards(WorkerConfig(reward="tests.worker.trl_rewards_example:length"))
    assert single.per_sample is None and [f.name for f in single.batched] == ["length"]
    legacy = load_rewards(WorkerConfig(reward="tests.worker.plugins_example:length_reward"))
    assert legacy.per_sample is not None and not legacy.batched and legacy.per_sample_name == "length_reward"
    several = load_rewards(WorkerConfig(rewards=["loraflow:exact_match", "loraflow:format",
                                                 "tests.worker.trl_rewards_example:length"],
                                        reward_weights=[1.0, 0.1, -0.01]))
    assert [(f.name, f.weight) for f in several.batched] == [("exact_match", 1.0), ("format", 0.1),
                                                             ("length", -0.01)]
    assert load_reward("loraflow:format") is format_reward and load_rewards(WorkerConfig()).empty


@pytest.mark.parametrize(("worker", "message"), [
    ({"rewards": ["loraflow:nope"]}, r"worker.rewards\[0\] = 'loraflow:nope': no such built-in reward"),
    ({"rewards": ["tests.worker.plugins_example:length_reward"]}, r"worker.rewards\[0\].*per-sample signature"),
    ({"rewards": ["tests.worker.nowhere:f"]}, r"worker.rewards\[0\] = 'tests.worker.nowhere:f': cannot import"),
    ({"reward": "tests.worker.plugins_example:not_an_env"}, r"worker.reward = .* is not callable"),
])
def test_bad_reward_settings_are_config_errors(worker: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_rewards(WorkerConfig(**worker))


def test_a_reward_module_in_the_working_directory_is_importable(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "my_cwd_rewards.py").write_text("def f(prompts, completions, **kw):\n    return [2.0] * len(prompts)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (fn,) = load_rewards(WorkerConfig(rewards=["my_cwd_rewards:f"])).batched
    assert fn.fn(prompts=["a"], completions=["b"]) == [2.0]


# -- combining a group ----------------------------------------------------------------------------------------------


def score(*functions: RewardFunction, num_samples: int = 4, timeout_s: float = 5.0, **columns: Any) -> Any:
    inputs = GroupInputs(prompts=["p"] * num_samples, completions=[f"c{i}" for i in range(num_samples)],
                         completion_ids=[[1] * (i + 1) for i in range(num_samples)], columns=columns)
    scoring = GroupScoring(functions, inputs, timeout_s=timeout_s)
    return wait_for(scoring.result, timeout_s + 5, "the group's rewards")


def test_weighted_sum_with_none_left_out_as_trl_does() -> None:
    result = score(RewardFunction(name="length", fn=examples.length, weight=2.0),
                   RewardFunction(name="half", fn=examples.half_the_time, weight=0.5),
                   RewardFunction(name="never", fn=examples.never_applies, weight=10.0))
    assert result.rewards == [2 * 1 + 0.5, 2 * 2, 2 * 3 + 0.5, 2 * 4] and not result.failures
    assert result.means == {"length": 2.5, "half": 1.0}  # "never" applied to no sample: absent
    alone = score(RewardFunction(name="never", fn=examples.never_applies))
    assert alone.rewards == [0.0] * 4 and alone.num_all_none == 4 and alone.means == {}


@pytest.mark.parametrize(("fn", "reason"), [(examples.raises, "exception"), (examples.not_finite, "nan"),
                                            (examples.too_few, "type"), (examples.hangs, "timeout")])
def test_a_failing_function_zeroes_the_group_and_is_named(fn: Any, reason: str) -> None:
    result = score(RewardFunction(name="length", fn=examples.length), RewardFunction(name="bad", fn=fn),
                   timeout_s=0.3)
    assert result.rewards == [0.0] * 4 and [(f.function, f.reason) for f in result.failures] == [("bad", reason)]


def test_rollouts_score_groups_with_trl_rewards_and_count_failures_per_function() -> None:
    backend = ScriptedBackend(lambda i, t: ("#### 7" if i % 2 == 0 else "#### 8", True))
    config = WorkerConfig(chunk_tokens=4, max_new_tokens=32, reward_timeout_s=0.5,
                          rewards=["loraflow:exact_match", "tests.worker.trl_rewards_example:by_level"],
                          reward_weights=[1.0, 0.25])
    rollouts = Rollouts(backend, EnvResolver(""), config, worker_id="w1", max_seq_len=512, metrics=Metrics(),
                        rewards=load_rewards(config))
    item = lease("0:0", prompt="3+4=", answer="7", group_size=4)
    rollouts.add(msgspec.structs.replace(item, columns={"answer": "7", "level": 2}))
    (finished,) = run_to_end(rollouts)
    group: RolloutGroup = finished.group
    assert group.rewards == [1.5, 0.5, 1.5, 0.5] and group.finish_reasons == ["stop"] * 4
    assert group.reward_means == {"exact_match": 0.5, "by_level": 2.0}
    assert reward_means_of([group, group]) == {"exact_match": 0.5, "by_level": 2.0}

    broken = WorkerConfig(**{**{f: getattr(config, f) for f in ("chunk_tokens", "max_new_tokens",
                                                                   "reward_timeout_s")},
                             "rewards": ["tests.worker.trl_rewards_example:raises", "loraflow:format"]})
    rollouts = Rollouts(backend, EnvResolver(""), broken, worker_id="w1", max_seq_len=512, metrics=Metrics(),
                        rewards=load_rewards(broken))
    rollouts.add(lease("0:1", group_size=3))
    (finished,) = run_to_end(rollouts)
    assert finished.group.rewards == [0.0] * 3 and finished.group.finish_reasons == ["error"] * 3
    assert finished.group.num_reward_failures == 3 and finished.group.reward_means is None
    assert rollouts.metrics.counter("reward_failures", reason="exception") == 3
    assert rollouts.metrics.counter("reward_failures_by_function", function="raises", reason="exception") == 3
    assert rollouts.metrics.counter("reward_failures_by_function", function="format", reason="exception") == 0


def test_a_per_sample_reward_failure_is_counted_under_its_name() -> None:
    def grader(completion: str, answer: str, **info: Any) -> float:
        raise ValueError("no")

    backend = ScriptedBackend(lambda i, t: ("1", True))
    config = WorkerConfig(chunk_tokens=4, max_new_tokens=8, reward_timeout_s=5.0)
    rollouts = Rollouts(backend, EnvResolver(""), config, worker_id="w1", max_seq_len=512, metrics=Metrics(),
                        reward_fn=grader)
    rollouts.add(lease("0:0", group_size=2))
    (finished,) = run_to_end(rollouts)
    assert finished.group.rewards == [0.0, 0.0]
    assert rollouts.metrics.counter("reward_failures_by_function", function="grader", reason="exception") == 2


def test_an_abandoned_call_that_keeps_computing_is_named_and_one_that_sleeps_is_not() -> None:
    """A call past its deadline whose thread still uses a core is stuck (it holds the GIL the engine needs); one
    that hangs asleep costs nothing and is not."""
    import time

    from loraflow.rollout_worker.rewards import guard

    watch = guard.RunawayWatch()
    sleeping = guard.GuardedCall(examples.hangs, [], [], timeout_s=0.1)
    time.sleep(0.2)
    assert sleeping.poll().failure == "timeout"
    time.sleep(guard.STUCK_AFTER_S)
    assert watch.check() == []  # abandoned, asleep: it uses no CPU
    spinning = guard.GuardedCall(examples.spins, [], [], timeout_s=0.1)
    try:
        time.sleep(0.2)
        assert spinning.poll().failure == "timeout"
        assert watch.check() == []  # the first look since the spinner was abandoned is not yet STUCK_AFTER_S old
        time.sleep(guard.STUCK_AFTER_S)
        stuck = watch.check()
        assert [c.name for c in stuck] == ["spins"] and stuck[0].cpu_share >= guard.STUCK_CPU_SHARE, stuck
    finally:
        examples.SPIN_STOP.set()  # never leave a spinning thread in the test process
    wait_for(lambda: not spinning._thread.is_alive(), 10, "the spinning call's thread to end once told")


# -- through a real worker and broker -----------------------------------------------------------------------------


@pytest.mark.slow
def test_extra_columns_reach_a_trl_reward_in_a_real_worker(procs: Processes, tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    """A JSONL dataset with extra columns, a reward module in the worker's working directory (not on
    PYTHONPATH), the ``loraflow`` console script: kwargs arrive, rewards combine, reward_means reach a learner."""
    from tests.broker.clients import Learner

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i, "tests": [i, -i]})
                            + "\n" for i in range(1, 8)))
    (tmp_path / "user_rewards.py").write_text((REPO / "tests" / "worker" / "trl_rewards_example.py").read_text())
    log_path = tmp_path / "reward_calls.jsonl"
    broker = start_broker(procs, f'model.path="{tiny_model_dir}"', f'run.task="{data}"', "run.group_size=2",
                          "run.groups_per_step=2", "broker.num_epochs=1", *FAST)
    args = [sys.executable.replace("python", "loraflow") if False else str(Path(sys.executable).parent / "loraflow"),
            "worker", "--endpoint", broker.endpoint, "--run-dir", str(broker.run_dir), "--worker-id", "w1",
            "--backend", "hf", "--log-format", "json"]
    for override in (*FAST, f'model.path="{tiny_model_dir}"', f'run.task="{data}"', "worker.max_new_tokens=4",
                     "worker.num_threads=1", 'worker.rewards=["user_rewards:by_level", "user_rewards:half_the_time"]',
                     "worker.reward_weights=[1.0, 10.0]"):
        args += ["--set", override]
    worker = procs.spawn("w1", args, env=child_env(REWARD_LOG=str(log_path)), cwd=tmp_path)
    wait_for(lambda: len(acked(worker)) >= 2, 90, "two groups scored by the user's rewards", procs)
    calls = [json.loads(line) for line in log_path.read_text().splitlines()]
    by_prompt = {c["prompts"][0]: c for c in calls}
    assert len(by_prompt) >= 2 and set(by_prompt) <= {f"{i}+{i}=" for i in range(2, 8)}  # row 1 is held out
    for prompt, call in by_prompt.items():
        i = int(prompt.split("+")[0])
        assert call["level"] == [i, i] and call["kwargs"]["tests"] == [[i, -i]] * 2
        assert call["kwargs"]["answer"] == [str(2 * i)] * 2 and len(call["completions"]) == 2
        assert all(isinstance(c, str) for c in call["completions"]) and all(n >= 1 for n in call["num_ids"])
    submitted = {e["group_id"]: e["reward"] for e in events(worker, "group_submitted")}
    assert submitted and all(r > 0 for r in submitted.values())
    learner = Learner(broker.endpoint, token=broker.run_token)
    batch = learner.batch(2, wait_ms=5000, timeout_s=10).record
    assert len(batch.groups) == 2
    for entry in batch.groups:
        i = int(entry.group.group_id.split(":")[1]) + 2  # train index 0 is row 2
        assert entry.group.rewards == [i + 10.0, float(i)]
        assert entry.group.reward_means == {"by_level": float(i), "half_the_time": 1.0}
    learner.close()
    assert worker.stop() == 0
    assert not os.environ.get("REWARD_LOG")
    assert Kind.BATCH  # the learner's view above went through the real protocol


@pytest.mark.slow
def test_a_reward_that_keeps_computing_past_its_timeout_restarts_the_worker(procs: Processes, tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    """A TRL reward that runs away in pure Python: the group scores 0 at worker.reward_timeout_s, and since the
    abandoned thread keeps a core busy the worker stops with EXIT_USER_CODE_STUCK (restarted like a crash), naming
    the function, after submitting what it scored and returning the leases it held."""
    from loraflow.common.cli import EXIT_USER_CODE_STUCK

    broker = start_broker(procs, f'model.path="{tiny_model_dir}"', "run.group_size=2", *FAST)
    args = [str(Path(sys.executable).parent / "loraflow"), "worker", "--endpoint", broker.endpoint, "--run-dir",
            str(broker.run_dir), "--worker-id", "w1", "--backend", "hf", "--log-format", "json"]
    for override in (*FAST, f'model.path="{tiny_model_dir}"', "worker.max_new_tokens=4", "worker.num_threads=1",
                     'worker.reward="tests.worker.trl_rewards_example:spins"', "worker.reward_timeout_s=0.5",
                     "worker.max_failed_reward_groups=0"):  # else 8 zero-reward groups may stop it first
        args += ["--set", override]
    worker = procs.spawn("w1", args, cwd=REPO)
    wait_for(lambda: not worker.alive(), 90, "the worker to stop for its stuck reward", procs)
    assert worker.popen.returncode == EXIT_USER_CODE_STUCK, worker.log()[-3000:]
    (stuck,) = events(worker, "user_code_stuck")
    assert stuck["calls"][0].startswith("spins: ") and "worker.reward_timeout_s" in stuck["error"], stuck
    submitted = events(worker, "group_submitted")
    assert submitted and all(e["reward"] == 0.0 for e in submitted), submitted  # the timed-out reward scores 0
    assert events(worker, "stopped"), worker.log()[-3000:]  # a clean stop: what it held went back to the broker


@pytest.mark.slow
def test_a_conversational_dataset_row_reaches_a_trl_reward_through_the_chat_template(zoo_model: Any,
                                                                                    tmp_path: Path) -> None:
    """A JSONL row with a message-list prompt, a system prompt and an extra column: the lease crosses the wire,
    the hf backend renders it with the model's template, and the reward gets TRL's conversational inputs."""
    from transformers import AutoTokenizer

    from loraflow.common import codec
    from loraflow.common.config import DataConfig
    from loraflow.common.protocol import LeaseGrant, PromptLease
    from loraflow.common.tasks import load_task
    from loraflow.rollout_worker.backends.base import Sampling
    from loraflow.rollout_worker.backends.hf import HfBackend
    from loraflow.rollout_worker.rewards import RewardSet

    model_dir = zoo_model("qwen2")
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                                        "answer": str(2 * i), "difficulty": "easy"}) + "\n" for i in range(3)))
    item = load_task(str(path), data=DataConfig(system_prompt="Be brief.", eval_fraction=0)).item(1)
    sent = PromptLease(lease_id="l1", group_id="0:1", prompt_index=1, epoch=0, task=str(path), group_size=3,
                       deadline_s=60.0, **item.lease_fields())
    grant, _ = codec.decode([bytes(f) for f in codec.encode(LeaseGrant(leases=[sent]))])
    (received,) = grant.leases
    assert received.prompt_value == item.prompt and received.columns == item.columns

    calls: list[dict[str, Any]] = []

    def recorder(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                 **kwargs: Any) -> list[float]:
        calls.append({"prompts": prompts, "completions": completions, "ids": completion_ids, **kwargs})
        return [0.5] * len(completions)

    backend = HfBackend(model_dir, sampling=Sampling(), device="cpu", seed=0)
    config = WorkerConfig(chunk_tokens=8, max_new_tokens=8, reward_timeout_s=30.0)
    rollouts = Rollouts(backend, EnvResolver(""), config, worker_id="w1", max_seq_len=256, metrics=Metrics(),
                        rewards=RewardSet(batched=(RewardFunction(name="recorder", fn=recorder),)))
    rollouts.add(received)
    (finished,) = run_to_end(rollouts, timeout_s=60)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = tokenizer.apply_chat_template(item.prompt, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert finished.group.prompt_lens == [len(expected)] * 3 and finished.group.rewards == [0.5] * 3
    (call,) = calls
    assert call["prompts"] == [item.prompt] * 3 and call["prompts"][0][0] == {"role": "system", "content": "Be brief."}
    assert call["difficulty"] == ["easy"] * 3 and call["answer"] == ["2"] * 3
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in call["completions"])
    assert [len(ids) for ids in call["ids"]] == finished.group.completion_lens
    assert finished.group.reward_means == {"recorder": 0.5}
