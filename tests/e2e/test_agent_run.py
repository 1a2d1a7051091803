"""`loraflow run` of the calculator-agent example config: an openai-client harness trains through the gateway.

On a realistic random Qwen2-family model (its chat template) the harness plays multi-turn tool episodes through
each worker's gateway; what is checked is the plumbing end to end: learner steps complete on groups whose
samples are agent trajectories (per-sample prompts, context tokens masked), every trained prompt exactly once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loraflow.deploy import rundir
from tests.e2e.accounting import check_exactly_once, read_run
from tests.support import REPO, Processes, wait_for

pytestmark = pytest.mark.slow

NUM_STEPS = 3


def test_the_calculator_agent_config_trains_through_the_gateway(procs: Processes, tmp_path: Path, zoo_model) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "loraflow.deploy.cli", "run", str(REPO / "deploy/configs/calculator-agent.toml"),
            "--model", str(zoo_model("qwen2")), "--run-dir", str(run_dir), "--num-steps", str(NUM_STEPS),
            "--set", "worker.max_new_tokens=16", "--set", "worker.chunk_tokens=16", "--set", "eval.num_prompts=2",
            "--set", "launch.progress_every_s=1"]
    launcher = procs.spawn("launcher", argv)
    wait_for(lambda: not launcher.alive(), 300, "loraflow run of calculator-agent.toml to finish", procs)
    out = launcher.log()
    assert launcher.popen.returncode == 0, out + procs.logs()
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    check_exactly_once(read_run(run_dir))
    worker_logs = "".join(p.read_text() for p in run_dir.glob("logs/worker*.log"))
    assert "gateway_ready" in worker_logs and "agent_failed" not in worker_logs
