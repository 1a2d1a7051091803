"""Fixtures of the end-to-end tests: one torch thread in-process, and a quickly warmed-up base model.

A random-init model never earns a reward, so no group would have reward variance and nothing would be trained;
150 supervised steps give a base that sometimes answers right (a few % greedy), enough for GRPO groups with
signal, in about half a minute, once per test run (:func:`tests.shared_build.built_once`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_build import built_once
from tests.torch_threads import one_torch_thread  # noqa: F401  (an autouse fixture for this package)

QUICK_STEPS = 150


@pytest.fixture(scope="session")
def quick_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.deploy.demo_base import Recipe, build_demo_base

    recipe = Recipe(lr=2e-3, min_correct_steps=QUICK_STEPS, max_correct_steps=QUICK_STEPS, sloppy_steps=0,
                    max_extra_rounds=0, min_carry_free_accuracy=0.0, accuracy_window=(0.0, 1.0),
                    num_eval_prompts=50)
    return built_once(tmp_path_factory, "quick-base",
                      lambda directory: build_demo_base(directory, seed=0, recipe=recipe))
