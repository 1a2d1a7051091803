"""Shared fixtures: the tiny model (built once per session), process management, a broker factory; and how the
suite's parallel run (pytest-xdist, ``make test``) splits it.

Under ``--dist loadscope`` each work unit runs in one xdist worker, its tests in order: a module (its module
fixtures are built once), or a whole directory whose tests hold something of the machine (:data:`MACHINE_WIDE_DIRS`):
the one-node Slurm cluster (fixed ports, one per machine) and the network namespaces of the multi-host bed; the
modules sharing the session's vLLM engine form one unit too (:data:`SESSION_ENGINE_MODULES`).
(xdist's ``loadgroup`` marks would say the same per test, but xdist 3.8 writes the group into a node id field
pytest 9 no longer reads, so the unit is chosen here, from the node id.)

Units are handed out longest first (:data:`UNIT_SECONDS_FILE`: each unit's seconds in a recorded run), so the run
does not end with one worker alone on a long vLLM or end-to-end module that happened to be collected last; units
the file does not name go after the known ones (in xdist's order: most tests first). ``make test-durations``
records the file again (``LORAFLOW_RECORD_UNIT_SECONDS=1``); any run prints each worker's finishing time and the
longest units.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.support import Processes

#: test directories (under tests/) whose tests share a machine-wide resource: one work unit each
MACHINE_WIDE_DIRS = ("slurm", "net")
#: the modules that use tests/worker/conftest.py's session vLLM engine (``vllm_session_backend``, also through the
#: ``backend`` fixture): one work unit, so the engine (~30 s to start on 2 cores) starts once, not in each worker
SESSION_ENGINE_UNIT = "tests/worker (session vLLM engine)"
SESSION_ENGINE_MODULES = frozenset(f"tests/worker/{name}.py" for name in (
    "test_backends", "test_served_evidence", "test_vllm_stream", "test_gateway_stream", "test_gateway",
    "test_vllm_lora_cpu"))
#: {work unit: seconds (setup + call + teardown of its tests)} from a recorded run; the scheduling order
UNIT_SECONDS_FILE = Path(__file__).parent / "unit_seconds.json"


def work_unit(nodeid: str) -> str:
    """The unit a test runs in under xdist: its machine-wide directory, the session engine's unit, else its
    module."""
    module = nodeid.split("::", 1)[0]
    if module in SESSION_ENGINE_MODULES:
        return SESSION_ENGINE_UNIT
    parts = module.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in MACHINE_WIDE_DIRS:
        return "/".join(parts[:2])
    return module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with :func:`work_unit` as the scope (other modes: xdist's own)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    expected = json.loads(UNIT_SECONDS_FILE.read_text()) if UNIT_SECONDS_FILE.exists() else {}

    class WorkUnits(LoadScopeScheduling):
        longest_first = False

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.longest_first:  # schedule() has queued every unit before it assigns the first one
                self.longest_first = True
                order = sorted(self.workqueue, key=lambda unit: -expected.get(unit, 0.0))  # stable: new units last
                self.workqueue = type(self.workqueue)((unit, self.workqueue[unit]) for unit in order)
            super()._assign_work_unit(node)

    return WorkUnits(config, log)


class UnitClock:
    """Seconds per work unit and when each xdist worker (or the one process) reported its last test."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.unit_seconds: dict[str, float] = defaultdict(float)
        self.worker_done_s: dict[str, float] = {}

    def add(self, report: pytest.TestReport) -> None:
        self.unit_seconds[work_unit(report.nodeid)] += report.duration
        gateway = getattr(getattr(report, "node", None), "gateway", None)
        self.worker_done_s[gateway.id if gateway else "main"] = time.monotonic() - self.started

    def summary(self, terminalreporter: Any) -> None:
        if not self.unit_seconds:
            return
        longest = sorted(self.unit_seconds.items(), key=lambda item: -item[1])
        done = ", ".join(f"{worker} {seconds:.0f} s" for worker, seconds in sorted(self.worker_done_s.items()))
        terminalreporter.write_line(f"work units: {len(longest)}; last test reported: {done}")
        terminalreporter.write_line("longest units: " + ", ".join(f"{unit} {s:.0f} s" for unit, s in longest[:8]))
        if os.environ.get("LORAFLOW_RECORD_UNIT_SECONDS") == "1":
            UNIT_SECONDS_FILE.write_text(json.dumps({unit: round(s, 1) for unit, s in longest}, indent=0) + "\n")
            terminalreporter.write_line(f"recorded {UNIT_SECONDS_FILE}")


_clock: UnitClock | None = None  # the controller's (or a serial run's); None in an xdist worker


def pytest_configure(config: pytest.Config) -> None:
    global _clock
    if not hasattr(config, "workerinput"):
        _clock = UnitClock()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _clock is not None:
        _clock.add(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _clock is not None:
        _clock.summary(terminalreporter)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Llama + byte tokenizer, built offline once per test session."""
    from loraflow.common.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory: pytest.TempPathFactory):
    """``zoo_model(family)``: a loraflow.common.model_zoo model directory (llama3, qwen2, qwen3, gemma), built once per session."""
    from loraflow.common.model_zoo import build_model

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
