"""Environments behind one interface (:mod:`.base`): built-in single-turn and calculator-tool tasks, user ones.

:class:`EnvResolver` picks the environment for each lease: ``worker.env`` when set (a user environment for every
task), else the built-in one for the lease's task (``calculator`` -> :class:`CalculatorEnv`, anything else ->
:class:`SingleTurnEnv` with the exact-answer score of :mod:`loraflow.common.tasks`).
"""

from __future__ import annotations

from loraflow.common.config import ConfigError
from loraflow.common.task_base import Task
from loraflow.common.tasks import BUILTIN_TASKS
from loraflow.rollout_worker.envs.base import Environment, Episode, Step
from loraflow.rollout_worker.envs.calculator import CalculatorEnv
from loraflow.rollout_worker.envs.single_turn import SingleTurnEnv
from loraflow.rollout_worker.plugins import load_object

__all__ = ["CalculatorEnv", "EnvResolver", "Environment", "Episode", "SingleTurnEnv", "Step", "check_env",
           "load_env"]


def check_env(spec: str) -> object:
    """The class or instance ``worker.env`` names, checked to be an Environment without instantiating it."""
    obj = load_object(spec, "worker.env")
    if not (issubclass(obj, Environment) if isinstance(obj, type) else isinstance(obj, Environment)):
        raise ConfigError(f"worker.env = {spec!r} is not an Environment (subclass loraflow.rollout_worker.envs.Environment)")
    return obj


def load_env(spec: str) -> Environment:
    """A user environment from ``package.module:Name`` (a class is instantiated without arguments)."""
    obj = check_env(spec)
    return obj() if isinstance(obj, type) else obj


def builtin_env(task: str) -> Environment:
    if task == "calculator":
        return CalculatorEnv()
    task_class = BUILTIN_TASKS.get(task)
    return SingleTurnEnv(task_class() if task_class is not None else Task())


class EnvResolver:
    """The environment of each task name, built once."""

    def __init__(self, env: str | Environment = "") -> None:
        """``env``: ``worker.env`` (an import path; empty = built-ins) or an Environment instance."""
        self._user = load_env(env) if isinstance(env, str) and env else env or None
        self._builtin: dict[str, Environment] = {}

    def for_task(self, task: str) -> Environment:
        if self._user is not None:
            return self._user
        if task not in self._builtin:
            self._builtin[task] = builtin_env(task)
        return self._builtin[task]
