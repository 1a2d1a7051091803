"""Fixtures of the end-to-end tests: one torch thread in-process, and quickly warmed-up base models.

A random-init model never earns a reward, so no group would have reward variance and nothing would be trained;
the quick recipe (deploy/demo_base.py ``QUICK_RECIPE``: 150 supervised steps) gives a base that sometimes answers
right, enough for GRPO groups with signal, in about half a minute, once per test run
(:func:`tests.shared_build.built_once`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_build import built_once
from tests.torch_threads import one_torch_thread  # noqa: F401  (an autouse fixture for this package)


@pytest.fixture(scope="session")
def quick_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.deploy.demo_base import QUICK_RECIPE, build_demo_base

    return built_once(tmp_path_factory, "quick-base",
                      lambda directory: build_demo_base(directory, seed=0, recipe=QUICK_RECIPE))


@pytest.fixture(scope="session")
def quick_agent_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent demo's quick base (deploy/agent_base.py ``QUICK_AGENT_RECIPE``: it writes the tool call's format)."""
    from loraflow.deploy.agent_base import QUICK_AGENT_RECIPE, build_agent_base

    return built_once(tmp_path_factory, "quick-agent-base",
                      lambda directory: build_agent_base(directory, seed=0, recipe=QUICK_AGENT_RECIPE))
