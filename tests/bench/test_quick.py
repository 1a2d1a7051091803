"""Every bench in bench/ still runs: ``python -m bench.NAME --quick`` (small sizes, the real code path) as a
subprocess, ending with the one JSON line of bench/report.py. One test per bench (bench.harness.BENCHES)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import BENCHES
from tests.e2e.conftest import quick_agent_base, quick_base_dir  # noqa: F401  (the --quick modes' bases)

REPO = Path(__file__).resolve().parents[2]
KEYS = {"bench", "metric", "value", "unit", "reference", "ratio"}
#: benches whose quick mode needs more than this machine's usual parts, by the project's markers
MARKS = {
    "net_faults": [pytest.mark.net],  # network namespaces: root and iproute2
    # whole runs (broker, workers, learner, base models built and evaluated): tens of seconds each
    "agent_demo": [pytest.mark.slow],
    "time_to_accuracy": [pytest.mark.slow],
    "vs_trl": [pytest.mark.slow],
    "integrity": [pytest.mark.slow],
    "multi_tenant": [pytest.mark.slow],
}
#: benches whose quick mode trains on a quick base (deploy/demo_base.py ensure_quick_base, deploy/agent_base.py
#: ensure_quick_agent_base): the suite's own, built once per test run, is linked into their cache
QUICK_BASES = {"time_to_accuracy": "quick_base_dir", "vs_trl": "quick_base_dir", "agent_demo": "quick_agent_base",
               "multi_tenant": "quick_base_dir"}
#: seconds a quick run may take at most (a quick run takes seconds; the slow-marked ones a minute or two)
TIMEOUT_S = {"agent_demo": 420, "time_to_accuracy": 300, "vs_trl": 300, "integrity": 240, "net_faults": 300,
             "multi_tenant": 300}


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The benches' LORAFLOW_CACHE (built-in models, quick bases): nothing of the user's cache is read or written."""
    return tmp_path_factory.mktemp("bench-cache")


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS.get(n, [])) for n in BENCHES])
def test_quick_run_ends_with_the_json_line(name: str, request: pytest.FixtureRequest, bench_cache: Path) -> None:
    if name == "net_faults" and os.geteuid() != 0:
        pytest.fail("bench.net_faults needs root (network namespaces); deselect with -m 'not net'")
    if name == "vs_trl":
        pytest.importorskip("trl", reason="bench/vs_trl.py needs the [peer] extra")
    if name in QUICK_BASES:
        link_quick_base(bench_cache, request.getfixturevalue(QUICK_BASES[name]), agent=name == "agent_demo")
    done = subprocess.run([sys.executable, "-m", f"bench.{name}", "--quick"], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT_S.get(name, 120),
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "LORAFLOW_CACHE": str(bench_cache)})
    tail = (done.stdout[-3000:] + "\n" + done.stderr[-3000:]).strip()
    assert done.returncode == 0, f"bench.{name} --quick exited {done.returncode}:\n{tail}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"bench.{name} printed nothing:\n{tail}"
    line = json.loads(lines[-1])
    assert KEYS <= set(line), f"the last line lacks {sorted(KEYS - set(line))}: {lines[-1]}"
    assert line["bench"] == name


def link_quick_base(cache: Path, base: Path, *, agent: bool) -> None:
    """``base`` where the bench's quick mode looks for seed 0's quick base in ``cache``."""
    from loraflow.deploy.agent_base import QUICK_AGENT_RECIPE, agent_base_dir
    from loraflow.deploy.demo_base import QUICK_RECIPE, demo_base_dir

    quick = cache / "quick"
    entry = agent_base_dir(0, quick, QUICK_AGENT_RECIPE) if agent else demo_base_dir(0, quick, QUICK_RECIPE)
    if not entry.exists():
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.symlink_to(base, target_is_directory=True)


def test_make_bench_runs_these_benches() -> None:
    makefile = (REPO / "Makefile").read_text()
    listed = makefile.split("BENCHES :=", 1)[1].split("\nBENCH_ARGS", 1)[0].replace("\\", " ").split()
    assert tuple(listed) == BENCHES
    libraries = {"__init__", "report", "broker_proc", "harness", "netbed", "netns", "netproxy", "accuracy_runs",
                 "single_process", "gpu_smoke"}
    assert {p.stem for p in (REPO / "bench").glob("*.py")} == set(BENCHES) | libraries
