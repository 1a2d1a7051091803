"""Final answers stated in text: extraction and comparison, shared by the built-in rewards and held-out scoring.

Extraction (:func:`extract_answer`), in order of precedence:

1. the last ``\\boxed{...}`` (nested braces allowed), as math datasets write final answers;
2. the text after the last ``####`` (GSM8K's convention), up to the end of its line;
3. the last number in the text (``-1,234.5`` -> ``-1234.5``).

A reference answer that itself holds ``\\boxed{}`` or ``####`` (GSM8K's worked solutions) is extracted the same
way (:func:`reference_answer`). Numbers compare as numbers (``72`` = ``72.0`` = ``$72``), anything else as text
without surrounding space and case (:func:`answers_match`). :func:`is_correct` is the one verdict: the whole
completion equals the reference, or its extracted final answer does.
"""

from __future__ import annotations

import re
from typing import Any

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of TRL's assistant message(s)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def last_boxed(text: str) -> str | None:
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
    boxed = last_boxed(text)
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




def is_correct(completion: Any, answer: Any) -> bool:
    """Whether a completion states the reference answer: as a whole, or as its extracted final answer."""
    expected = reference_answer(answer)
    if expected is None:
        return False
    text = completion_text(completion)
    if answers_match(text, expected):
        return True
    predicted = extract_answer(text)
    return predicted is not None and answers_match(predicted, expected)
