"""tests/conftest.py's work units: the session vLLM engine's modules stay one unit as modules come and go."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import SESSION_ENGINE_MODULES, SESSION_ENGINE_UNIT, work_unit

WORKER_TESTS = Path(__file__).parent / "worker"
#: what makes a module use the session engine: the fixture by name, or the ``backend`` fixture (every backend)
USES_ENGINE = re.compile(r"\bvllm_session_backend\b|def test_\w+\([^)]*\bbackend\b")


def test_every_module_using_the_session_engine_is_in_its_unit() -> None:
    using = {f"tests/worker/{path.name}" for path in WORKER_TESTS.glob("test_*.py")
             if USES_ENGINE.search(path.read_text())}
    assert using == SESSION_ENGINE_MODULES


def test_work_units() -> None:
    assert work_unit("tests/worker/test_gateway.py::test_x[vllm]") == SESSION_ENGINE_UNIT
    assert work_unit("tests/worker/test_real_models.py::test_x") == "tests/worker/test_real_models.py"
    assert work_unit("tests/slurm/test_run.py::test_x") == "tests/slurm"
    assert work_unit("tests/net/test_bed.py::test_x") == "tests/net"
