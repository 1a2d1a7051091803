"""Shared fixtures: the tiny model (built once per session), process management, a broker factory; and how the
suite's parallel run (pytest-xdist, ``make test``) splits it.

Under ``--dist loadscope`` each work unit runs in one xdist worker, its tests in order: a module (its module
fixtures are built once), or a whole directory whose tests hold something of the machine (:data:`MACHINE_WIDE_DIRS`):
the one-node Slurm cluster (fixed ports, one per machine) and the network namespaces of the multi-host bed.
(xdist's ``loadgroup`` marks would say the same per test, but xdist 3.8 writes the group into a node id field
pytest 9 no longer reads, so the unit is chosen here, from the node id.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import Processes

#: test directories (under tests/) whose tests share a machine-wide resource: one work unit each
MACHINE_WIDE_DIRS = ("slurm", "net")


def work_unit(nodeid: str) -> str:
    """The unit a test runs in under xdist: its machine-wide directory, else its module."""
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in MACHINE_WIDE_DIRS:
        return "/".join(parts[:2])
    return module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with :func:`work_unit` as the scope (other modes: xdist's own)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


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
