"""Two opposite TRL-style rewards for the pool's isolation test (tests/e2e/test_pool_shared.py): one run is paid
for short completions, the other for long ones, so one adapter cannot satisfy both."""

from __future__ import annotations

from typing import Any

MAX_TOKENS = 16  # the completions' budget in the test (worker.max_new_tokens)


def short(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
    return [1.0 - min(len(ids), MAX_TOKENS) / MAX_TOKENS for ids in completion_ids]


def long(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
    return [min(len(ids), MAX_TOKENS) / MAX_TOKENS for ids in completion_ids]
