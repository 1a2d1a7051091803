"""Environments (single-turn, calculator tool), user code by import path, and guarded execution of user code."""

from __future__ import annotations

import threading
import time

import pytest

from loraflow.common.tasks import ArithTask
from loraflow.rollout_worker.envs import CalculatorEnv, EnvResolver, Episode, SingleTurnEnv, Step
from loraflow.rollout_worker.envs.calculator import calculate
from loraflow.rollout_worker.plugins import load_object
from loraflow.rollout_worker.rewards import GuardedCall, as_reward, call_guarded, load_reward

EPISODE = Episode(prompt="12+34=", answer="46", task="arith")


@pytest.mark.parametrize(("turn", "finished", "reward"), [
    ("46", True, 1.0), (" 46 ", True, 1.0), ("46", False, 0.0), ("47", True, 0.0), ("4", True, 0.0), ("", True, 0.0),
])
def test_single_turn_reward_is_exact_answer_then_eos(turn: str, finished: bool, reward: float) -> None:
    assert SingleTurnEnv(ArithTask()).step(None, turn, finished=finished, episode=EPISODE) == Step(done=True,
                                                                                                   reward=reward)


@pytest.mark.parametrize(("expression", "value"), [("2*3+1", 7), ("12 * 34 + 5", 413), ("-3+10", 7),
                                                   ("7/2", 3.5), ("7//2", 3), ("9%4", 1), ("(1+2)*3", 9)])
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "x+1", "2**100", "open('/etc/passwd')",
                                        "1/0", "9" * 30 + "*" + "9" * 30, "1+" * 150 + "1", "[1,2]", "'a'*3"])
def test_calculator_refuses_anything_but_bounded_arithmetic(expression: str) -> None:
    with pytest.raises(ValueError):
        calculate(expression)


def test_calculator_env_answers_tool_calls_then_scores_the_final_answer() -> None:
    env = CalculatorEnv()
    episode = Episode(prompt="12*34+5=", answer="413", task="calculator")
    assert env.step(None, "<calc>12*34+5</calc>", finished=False, episode=episode) == Step(done=False, reply="=413")
    assert env.step(None, "<calc>1/0</calc>", finished=False, episode=episode) == Step(done=False, reply="=error")
    assert env.step(None, "413", finished=True, episode=episode) == Step(done=True, reward=1.0)
    assert env.step(None, "<calc>1</calc>", finished=True, episode=episode) == Step(done=True, reward=0.0)
    assert env.step(None, "412", finished=True, episode=episode).reward == 0.0


def test_env_resolver_builtin_and_user_environments() -> None:
    resolver = EnvResolver()
    assert isinstance(resolver.for_task("calculator"), CalculatorEnv)
    assert isinstance(resolver.for_task("arith"), SingleTurnEnv)
    assert isinstance(resolver.for_task("data/prompts.jsonl"), SingleTurnEnv)
    assert resolver.for_task("arith") is resolver.for_task("arith")
    user = EnvResolver("tests.worker.plugins_example:CountingEnv")
    assert type(user.for_task("arith")).__name__ == "CountingEnv"
    assert user.for_task("calculator") is user.for_task("arith")


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.worker.plugins_example", "package.module:Name"),
    ("tests.worker.nope:Env", "cannot import"),
    ("tests.worker.plugins_example:Missing", "no attribute"),
    ("tests.worker.plugins_example:not_an_env", "not an Environment"),
])
def test_bad_user_environment_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EnvResolver(spec)


def test_user_reward_loading() -> None:
    assert load_reward("") is None
    fn = load_reward("tests.worker.plugins_example:length_reward")
    assert fn("abc", "", finished=True) == 3.5
    with pytest.raises(ValueError, match="not callable"):
        load_reward("tests.worker.plugins_example:not_an_env")
    assert load_object("loraflow.common.tasks:ArithTask.name", "x") == "arith"


@pytest.mark.parametrize(("value", "reason"), [(float("nan"), "nan"), (float("inf"), "nan"), ("1", "type"),
                                               (None, "type"), ([1.0], "type")])
def test_rewards_must_be_finite_numbers(value: object, reason: str) -> None:
    outcome = call_guarded(as_reward, value, timeout_s=5)
    assert outcome.failure == reason and not outcome.ok


def test_guarded_calls_fail_closed() -> None:
    assert call_guarded(lambda: 0.5, timeout_s=5).value == 0.5
    assert as_reward(True) == 1.0 and as_reward(3) == 3.0

    def boom() -> float:
        raise KeyError("missing")

    outcome = call_guarded(boom, timeout_s=5)
    assert outcome.failure == "exception" and "KeyError" in outcome.error
    release = threading.Event()
    started = time.monotonic()
    outcome = call_guarded(release.wait, 30, timeout_s=0.2)
    assert outcome.failure == "timeout" and "worker.reward_timeout_s" in outcome.error
    assert time.monotonic() - started < 5
    release.set()


def test_a_late_result_after_the_timeout_is_ignored() -> None:
    release, done = threading.Event(), threading.Event()
    call = GuardedCall(lambda: release.wait(10) and 1.0, timeout_s=0.05, on_done=done.set)
    assert call.poll() is None
    assert call.poll(call.deadline).failure == "timeout"
    release.set()
    assert not done.wait(0.3)  # on_done never fires for an abandoned call
    assert call.poll().failure == "timeout"
