"""Shared fixtures: the tiny model (built once per session), process management, a broker factory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import Processes


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Llama + byte tokenizer, built offline once per test session."""
    from common.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory: pytest.TempPathFactory):
    """``zoo_model(family)``: a common.model_zoo model directory (llama3, qwen2, qwen3, gemma), built once per session."""
    from common.model_zoo import build_model

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_model(family, tmp_path_factory.mktemp(f"zoo-{family}"), seed=0)
        return built[family]

    return get


@pytest.fixture
def procs(tmp_path: Path):
    """Start real processes for a test; all are killed at the end."""
    p = Processes(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()
