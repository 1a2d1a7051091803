"""TRL-style reward functions as users write them for GRPOTrainer, loaded by import path in tests."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


def by_level(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], level: list[int],
             **kwargs: Any) -> list[float]:
    """The dataset's ``level`` column as the reward; with REWARD_LOG set, every call's inputs go to that file."""
    path = os.environ.get("REWARD_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"prompts": prompts, "completions": completions, "num_ids": [len(c) for c in
                                completion_ids], "level": level, "kwargs": kwargs}) + "\n")
    return [float(x) for x in level]


def half_the_time(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Applies to even samples only (None elsewhere)."""
    return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


def never_applies(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[None]:
    return [None] * len(completions)


def raises(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    raise RuntimeError("grader unavailable")


def not_finite(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [float("nan")] * len(completions)


def too_few(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0]


def hangs(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    time.sleep(60)
    return [1.0] * len(completions)


def spins(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Runs away in pure Python (a solver or a regex that never ends), until SPIN_STOP is set."""
    while not SPIN_STOP.is_set():
        pass
    return [1.0] * len(completions)


SPIN_STOP = threading.Event()  # a test process sets it; a worker process never does


def length(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]
