"""A real worker process with worker.agent against a real broker: agent episodes become accepted groups."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.support import Processes, wait_for
from tests.worker.test_integration import acked, broker_for, events, start_worker

pytestmark = pytest.mark.slow


def test_worker_submits_groups_played_by_an_agent_harness(procs: Processes, tiny_model_dir: Path) -> None:
    broker = broker_for(procs, tiny_model_dir, "run.group_size=3")
    worker = start_worker(procs, broker, "agent1", 'worker.agent="tests.worker.gateway_agents:calculator_text"',
                          "worker.chunk_tokens=8", "worker.capacity=2", backend="hf")
    wait_for(lambda: len(acked(worker)) >= 3, 120, "3 accepted groups from agent episodes", procs)
    info_path = broker.run_dir / "workers" / "agent1" / "gateway.json"
    info = json.loads(info_path.read_text())
    (ready,) = events(worker, "gateway_ready")
    assert ready["url"] == info["url"] and info["url"].startswith("http://127.0.0.1:")
    # the same gateway answers an outside client while the worker plays its episodes
    client = openai.OpenAI(base_url=f"{info['url']}/v1", api_key="x", max_retries=0, timeout=60)
    reply = client.completions.create(model="loraflow", prompt="1+1=", max_tokens=3)
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
    submitted = events(worker, "group_submitted")
    assert len(submitted) >= 3 and not events(worker, "agent_failed")
    with urllib.request.urlopen(f"{info['url']}/v1/models", timeout=10) as response:
        assert json.load(response)["data"][-1]["id"] == "loraflow"
    assert worker.stop() == 0
