"""Built-in reward functions, TRL-style: ``worker.rewards = ["loraflow:exact_match", "loraflow:format"]``.

Both take what TRL's GRPOTrainer passes (``prompts``, ``completions``, ``completion_ids`` and the dataset
columns as keyword arguments) and return one float per completion, or None where they do not apply. A
completion is text, or TRL's conversational form ``[{"role": "assistant", "content": ...}]``.

Answer extraction (:func:`extract_answer`), in order of precedence:

1. the last ``\\boxed{...}`` (nested braces allowed), as math datasets write final answers;
2. the text after the last ``####`` (GSM8K's convention), up to the end of its line;
3. the last number in the text (``-1,234.5`` -> ``-1234.5``).

:func:`exact_match` compares the extraction from the completion with the reference answer (``answer``; a
reference that itself holds ``\\boxed{}`` or ``####``, like GSM8K's worked solutions, is extracted the same way):
numbers compare as numbers (``72`` = ``72.0`` = ``$72``), anything else as text without surrounding space and
case. :func:`format_reward` is 1.0 when the completion ends its reasoning with a final answer in one of the
extractable forms (``#### <answer>`` as its last line, or a ``\\boxed{}``), else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FINAL_LINE = re.compile(r"####\s*\S[^\n]*\s*$")


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of TRL's assistant message(s)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str | None:
    """The final answer a text states (see the module docstring), or None when it states none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    if cleaned.endswith("%"):
        cleaned = cleaned[:-1]
    try:
        return float(cleaned)
    except ValueError:
        match = _NUMBER.fullmatch(cleaned)
        return float(match.group().replace(",", "")) if match else None


def answers_match(predicted: str, reference: str) -> bool:
    """Equal as numbers when both are numbers, else as stripped, case-folded text."""
    a, b = _as_number(predicted), _as_number(reference)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return predicted.strip().casefold() == reference.strip().casefold()


def reference_answer(answer: Any) -> str | None:
    """The reference to compare with: extracted from a worked solution (``####``, ``\\boxed{}``), else as is."""
    if answer is None:
        return None
    text = str(answer)
    if "####" in text or "\\boxed{" in text:
        return extract_answer(text)
    return text.strip() or None


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
        out.append(1.0 if _FINAL_LINE.search(text) or _last_boxed(text) is not None else 0.0)
    return out


#: ``loraflow:<name>`` in worker.reward / worker.rewards
BUILTIN_REWARDS = {"exact_match": exact_match, "format": format_reward}
