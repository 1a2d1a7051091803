"""Built-in tasks: deterministic prompt sets and their exact-answer checks.

A task turns an index into a prompt (with its reference answer) and scores a completion. The broker uses
:meth:`Task.item` to lease prompts (the index is the dataset cursor, so a re-queued prompt is regenerated
identically), workers' environments use :meth:`Task.score`, and the launcher uses the ``eval`` split for
held-out accuracy. Train and eval problems are disjoint (a hash of the problem picks its split).

- ``arith``: two-digit addition, prompt ``"a+b="``, answer ``str(a+b)``; reward 1 for exactly the answer
  followed by end-of-sequence, else 0 (the recipe in FACTS.md).
- ``calculator``: a multi-turn tool task, ``"a*b+c="``; the model may call ``<calc>expr</calc>`` and the
  environment answers ``=value``; reward 1 for the exact final answer (see rollout_worker/envs).
- JSONL files: one ``{"prompt": ..., "answer": ..., "meta": {...}}`` object per line; scored by exact match
  of the stripped completion.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPLITS = ("train", "eval")


@dataclass(frozen=True, slots=True)
class TaskItem:
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


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
        return TaskItem(prompt, answer)


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
        return TaskItem(prompt, answer, {"tools": ["calc"]})


class JsonlTask(Task):
    """Prompts from a JSONL file; the first 10 % (at least one line, when there are two or more) are held out."""

    def __init__(self, path: str | Path) -> None:
        self.name = str(path)
        items = []
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{number}: each line needs a string field 'prompt'")
            answer = obj.get("answer", "")
            meta = obj.get("meta", {})
            if not isinstance(answer, str) or not isinstance(meta, dict):
                raise ValueError(f"{path}:{number}: 'answer' must be a string and 'meta' an object")
            items.append(TaskItem(obj["prompt"], answer, meta))
        if not items:
            raise ValueError(f"{path}: no prompts")
        num_eval = max(1, len(items) // 10) if len(items) >= 2 else 0
        self._splits = {"eval": items[:num_eval], "train": items[num_eval:]}
        self.size = len(self._splits["train"])

    def item(self, index: int, split: str = "train") -> TaskItem:
        items = self._splits[split]
        if not items:
            raise ValueError(f"{self.name}: the {split} split is empty")
        return items[index % len(items)]


BUILTIN_TASKS = {"arith": ArithTask, "calculator": CalculatorTask}


def load_task(spec: str, seed: int = 0) -> Task:
    """A built-in task by name, or a JSONL file by path; raises ValueError naming the choices."""
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec](seed)
    if spec.endswith(".jsonl"):
        if not Path(spec).is_file():
            raise ValueError(f"run.task: JSONL file {spec} does not exist")
        return JsonlTask(spec)
    raise ValueError(f"run.task: unknown task {spec!r}; built-in: {sorted(BUILTIN_TASKS)}, or a .jsonl file")
