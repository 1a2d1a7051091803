"""Built-in tasks: deterministic prompt sets and their exact-answer checks.

A task turns an index into a prompt (with its reference answer) and scores a completion. The broker uses
:meth:`Task.item` to lease prompts (the index is the dataset cursor, so a re-queued prompt is regenerated
identically), workers' environments use :meth:`Task.score`, and the launcher uses the ``eval`` split for
held-out accuracy. Train and eval problems are disjoint (a hash of the problem picks its split).

- ``arith``: two-digit addition, prompt ``"a+b="``, answer ``str(a+b)``; reward 1 for exactly the answer
  followed by end-of-sequence, else 0 (the recipe in FACTS.md).
- ``calculator``: a multi-turn tool task, ``"a*b+c="``; the model may call ``<calc>expr</calc>`` and the
  environment answers ``=value``; reward 1 for the exact final answer (see rollout_worker/envs).
- datasets (:mod:`loraflow.common.dataset`): JSONL, JSON, Parquet and CSV files, ``save_to_disk`` directories and
  directories of data files, read with Hugging Face ``datasets``; held-out completions scored by the
  answer they state (:mod:`loraflow.common.answers`), training samples by the configured reward functions.

A prompt is TRL's: a string, or a conversation (a list of ``{"role", "content"}`` messages). An item's
``columns`` are the keyword arguments its reward functions receive (the dataset row without its prompt; the
built-in tasks send their answer).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraflow.common.config import DataConfig

SPLITS = ("train", "eval")

#: a prompt: a string, or chat messages ``[{"role": ..., "content": ...}]`` (TRL's conversational format)
Prompt = str | list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class TaskItem:
    prompt: Prompt
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    #: keyword arguments of the reward functions: every column of the row but the prompt
    columns: dict[str, Any] = field(default_factory=dict)

    def lease_fields(self) -> dict[str, Any]:
        """The PromptLease fields that carry this item (a conversation goes in ``prompt_messages``)."""
        text = self.prompt if isinstance(self.prompt, str) else ""
        messages = None if isinstance(self.prompt, str) else self.prompt
        return {"prompt": text, "answer": self.answer, "meta": self.meta, "prompt_messages": messages,
                "columns": self.columns or None}


class Task:
    """A prompt set: ``item(index, split)`` is deterministic; ``size`` is None for generated tasks."""

    name = "task"
    size: int | None = None

    def item(self, index: int, split: str = "train") -> TaskItem:
        raise NotImplementedError

    def score(self, completion: str, answer: str, *, finished: bool) -> float:
        """1.0 for exactly the answer (and a proper end, ``finished``), else 0.0."""
        return 1.0 if finished and completion.strip() == answer else 0.0


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
    from loraflow.common.config import ConfigError, DataConfig

    if spec in BUILTIN_TASKS:
        if data is not None and data != DataConfig():
            raise ConfigError(f"[data] settings apply to dataset tasks; run.task = {spec!r} is built in: remove them")
        return BUILTIN_TASKS[spec](seed)
    from loraflow.common.dataset import DatasetTask, is_dataset_spec

    if is_dataset_spec(spec):
        return DatasetTask(spec, data)
    raise ConfigError(f"run.task: unknown task {spec!r}; built-in: {sorted(BUILTIN_TASKS)}, or a dataset (a .jsonl, "
                      ".json, .parquet or .csv file, a save_to_disk directory, a directory of data files)")
