"""Built-in reward functions, TRL-style: ``worker.rewards = ["loraflow:exact_match", "loraflow:format"]``.

Both take what TRL's GRPOTrainer passes (``prompts``, ``completions``, ``completion_ids`` and the dataset
columns as keyword arguments) and return one float per completion, or None where they do not apply. A
completion is text, or TRL's conversational form ``[{"role": "assistant", "content": ...}]``.

Answers are extracted and compared by :mod:`loraflow.common.answers` (``\\boxed{}``, then ``####``, then the last number;
numbers compare as numbers), the same rules the held-out evaluation of a dataset task scores with.
:func:`exact_match` is 1.0 when the completion's final answer equals the reference ``answer``.
:func:`format_reward` is 1.0 when the completion ends its reasoning with a final answer in one of the
extractable forms (``#### <answer>`` as its last line, or a ``\\boxed{}``), else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

from loraflow.common.answers import (
    answers_match,
    completion_text,
    extract_answer,
    last_boxed,
    reference_answer,
)

_FINAL_LINE = re.compile(r"####\s*\S[^\n]*\s*$")


def exact_match(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, *,
                answer: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference ``answer``, else 0.0; None without one."""
    references = answer if answer is not None else [None] * len(completions)
    out: list[float | None] = []
    for completion, ref in zip(completions, references, strict=True):
        expected = reference_answer(ref)
        if expected is None:
            out.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        out.append(1.0 if predicted is not None and answers_match(predicted, expected) else 0.0)
    return out


def format_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                  **kwargs: Any) -> list[float | None]:
    """1.0 when the completion ends with ``#### <answer>`` or holds a ``\\boxed{...}``, else 0.0."""
    out: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        out.append(1.0 if _FINAL_LINE.search(text) or last_boxed(text) is not None else 0.0)
    return out


#: ``loraflow:<name>`` in worker.reward / worker.rewards
BUILTIN_REWARDS = {"exact_match": exact_match, "format": format_reward}
