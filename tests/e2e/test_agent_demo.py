"""`loraflow run` of the agent demo, shortened: the openai-client harness trains through the gateway with tool turns.

The demo config as it is (harness, heavy-tailed tool, chat template, hermes parsing, agent-aware evaluation) on
a base warmed up for a fraction of the demo's recipe, which already writes the tool call's format. The worker
runs the demo's harness through a wrapper (:func:`recording_episode`) that, before the episode ends, reads its
session's recorded trajectory from the gateway (``GET /sessions/<id>/trajectory``: what the group submits)
into a file: so the test sees that learner steps complete on groups whose samples hold tool turns, i.e.
context tokens (loss mask 0) between generated turns, and that the launcher's base and final accuracy were
measured by playing the same harness.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from loraflow.deploy import rundir
from loraflow.deploy.agents.agent_demo import run_episode
from tests.e2e.accounting import check_exactly_once, read_run
from tests.support import REPO, Processes, child_env, wait_for

pytestmark = pytest.mark.slow

NUM_STEPS = 3
EPISODES_FILE = "LORAFLOW_TEST_EPISODES"


async def recording_episode(client: Any, row: dict[str, Any]) -> dict[str, float]:
    """The demo's episode, then its session's trajectory appended to the file ``$LORAFLOW_TEST_EPISODES``."""
    result = await run_episode(client, row)
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/trajectory"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {client.api_key}"})
    trajectory = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(request, timeout=30).read()))
    with open(os.environ[EPISODES_FILE], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "result": result, "loss_mask": trajectory["loss_mask"],
                            "num_calls": len(trajectory["calls"])}) + "\n")
    return result


def test_the_agent_demo_trains_on_tool_turns(procs: Processes, tmp_path: Path, quick_agent_base: Path) -> None:
    run_dir, episodes = tmp_path / "run", tmp_path / "episodes.jsonl"
    argv = [sys.executable, "-m", "loraflow.deploy.cli", "run", str(REPO / "deploy/configs/agent-demo.toml"),
            "--model", str(quick_agent_base), "--run-dir", str(run_dir), "--num-steps", str(NUM_STEPS),
            "--set", "worker.agent=\"tests.e2e.test_agent_demo:recording_episode\"", "--set", "eval.num_prompts=8",
            "--set", "eval.every_s=0", "--set", "run.groups_per_step=4", "--set", "launch.progress_every_s=1"]
    launcher = procs.spawn("launcher", argv, env=child_env(**{EPISODES_FILE: str(episodes),
                                                              "LORAFLOW_AGENT_TOOL_MEDIAN_S": "0.05"}))
    wait_for(lambda: not launcher.alive(), 240, "loraflow run of agent-demo.toml to finish", procs)
    out = launcher.log()
    assert launcher.popen.returncode == 0, out + procs.logs()
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    check_exactly_once(read_run(run_dir))
    assert "base accuracy: " in out and "final accuracy: " in out
    records = [json.loads(line) for line in episodes.read_text().splitlines()]
    played = [e for e in records if e["pid"] != launcher.pid]  # the launcher's evaluation plays episodes too
    assert len(played) < len(records), "the evaluation did not play the harness"
    with_tool = [e for e in played if e["num_calls"] >= 2 and e["result"]["tool_calls"] >= 1]
    assert with_tool, f"no episode of {len(played)} made a tool call"
    for episode in with_tool:  # a tool result (and the template's markup) sits between two generated turns
        mask = episode["loss_mask"]
        first_context = mask.index(0, mask.index(1))
        assert 1 in mask[first_context:], mask
    worker_logs = "".join(p.read_text() for p in run_dir.glob("logs/worker*.log"))
    assert "gateway_ready" in worker_logs and "agent_failed" not in worker_logs
