"""What a task is: the :class:`Task` interface, the :class:`TaskItem` it makes of an index, and the :data:`Prompt`.

A task turns an index into a prompt (with its reference answer) and scores a completion. The broker uses
:meth:`Task.item` to lease prompts (the index is the dataset cursor, so a re-queued prompt is regenerated
identically), workers' environments use :meth:`Task.score`, and the launcher uses the ``eval`` split for
held-out accuracy. The built-in tasks (:mod:`loraflow.common.tasks`) and dataset tasks
(:mod:`loraflow.common.dataset`) both implement it; :func:`loraflow.common.tasks.load_task` picks one.

A prompt is TRL's: a string, or a conversation (a list of ``{"role", "content"}`` messages). An item's
``columns`` are the keyword arguments its reward functions receive (the dataset row without its prompt; the
built-in tasks send their answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
