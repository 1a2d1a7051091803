"""Built-in tasks (deterministic prompt sets with exact-answer checks) and :func:`load_task`, which names a task.

Each task implements :class:`loraflow.common.task_base.Task`. Train and eval problems are disjoint (a hash of
the problem picks its split).

- ``arith``: two-digit addition, prompt ``"a+b="``, answer ``str(a+b)``; reward 1 for exactly the answer
  followed by end-of-sequence, else 0 (the recipe in FACTS.md).
- ``calculator``: a multi-turn tool task, ``"a*b+c="``; the model may call ``<calc>expr</calc>`` and the
  environment answers ``=value``; reward 1 for the exact final answer (see rollout_worker/envs).
- datasets (:mod:`loraflow.common.dataset`): JSONL, JSON, Parquet and CSV files, ``save_to_disk`` directories and
  directories of data files, read with Hugging Face ``datasets``; held-out completions scored by the
  answer they state (:mod:`loraflow.common.answers`), training samples by the configured reward functions.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from loraflow.common.config import ConfigError, DataConfig
from loraflow.common.dataset import DatasetTask, is_dataset_spec
from loraflow.common.task_base import Task, TaskItem


def _split_of(key: str) -> str:
    return "eval" if zlib.crc32(key.encode()) % 10 == 0 else "train"


def _draw(rng: random.Random, split: str, make: Any) -> Any:
    """Draw problems from ``make(rng)`` until one lands in ``split`` (by its hash)."""
    while True:
        problem = make(rng)
        if _split_of(problem[0]) == split:
            return problem


class ArithTask(Task):
    name = "arith"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def item(self, index: int, split: str = "train") -> TaskItem:
        rng = random.Random(f"{self.name}/{self.seed}/{split}/{index}")

        def make(r: random.Random) -> tuple[str, str]:
            a, b = r.randint(10, 99), r.randint(10, 99)
            return f"{a}+{b}=", str(a + b)

        prompt, answer = _draw(rng, split, make)
        return TaskItem(prompt, answer, columns={"answer": answer})


class CalculatorTask(Task):
    name = "calculator"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def item(self, index: int, split: str = "train") -> TaskItem:
        rng = random.Random(f"{self.name}/{self.seed}/{split}/{index}")

        def make(r: random.Random) -> tuple[str, str]:
            a, b, c = r.randint(2, 99), r.randint(2, 99), r.randint(1, 999)
            return f"{a}*{b}+{c}=", str(a * b + c)

        prompt, answer = _draw(rng, split, make)
        return TaskItem(prompt, answer, {"tools": ["calc"]}, columns={"answer": answer})


BUILTIN_TASKS = {"arith": ArithTask, "calculator": CalculatorTask}


def load_task(spec: str, seed: int = 0, data: DataConfig | None = None) -> Task:
    """A built-in task by name, or a dataset by path (read as ``data`` says); raises a ConfigError naming the
    setting (a :class:`loraflow.common.dataset.DatasetError` for anything wrong with the data)."""
    if spec in BUILTIN_TASKS:
        if data is not None and data != DataConfig():
            raise ConfigError(f"[data] settings apply to dataset tasks; run.task = {spec!r} is built in: remove them")
        return BUILTIN_TASKS[spec](seed)
    if is_dataset_spec(spec):
        return DatasetTask(spec, data)
    raise ConfigError(f"run.task: unknown task {spec!r}; built-in: {sorted(BUILTIN_TASKS)}, or a dataset (a .jsonl, "
                      ".json, .parquet or .csv file, a save_to_disk directory, a directory of data files)")
