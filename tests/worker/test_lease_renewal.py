"""A generation that takes longer than ``broker.lease_timeout_s`` is not handed out a second time: the worker's
heartbeats name the leases it is still working on and the broker renews them, while the leases of a worker that
stops heartbeating (SIGKILL) still come back within the timeout. Real broker and sim worker processes."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import BrokerHandle, Processes, child_env, start_broker, wait_for

pytestmark = pytest.mark.slow

LEASE_TIMEOUT_S = 4.0
GENERATION_S = 10.0  # 30 tokens at 3 tokens/s: well past the lease timeout


def worker_argv(broker: BrokerHandle, worker_id: str) -> list[str]:
    argv = [sys.executable, "-m", "loraflow.rollout_worker", "--endpoint", broker.endpoint, "--run-dir", str(broker.run_dir),
            "--worker-id", worker_id, "--backend", "sim", "--log-format", "json"]
    for override in ("worker.sim.tokens_per_s=3", "worker.sim.mean_tokens=30", "worker.sim.length_sigma=0",
                     "worker.max_new_tokens=32", "worker.chunk_tokens=4", "worker.capacity=1"):
        argv += ["--set", override]
    return argv


def events(path: Path, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == name]


def test_a_long_generation_keeps_its_lease_and_a_dead_workers_lease_returns(procs: Processes) -> None:
    broker = start_broker(procs, "run.group_size=2", f"broker.lease_timeout_s={LEASE_TIMEOUT_S}")
    worker = procs.spawn("w1", worker_argv(broker, "w1"), env=child_env())
    wait_for(lambda: events(worker.log_path, "group_acked"), GENERATION_S * 4, "the first long group", procs)
    (first,) = events(worker.log_path, "group_submitted")[:1]
    assert first["generate_s"] > LEASE_TIMEOUT_S * 2  # it really outlived the timeout, twice over
    stats = broker.stats()
    assert stats["lease_events"].get("expired", 0) == 0, stats["lease_events"]
    assert stats["lease_events"]["renewed"] >= 2
    granted = [e["group_id"] for e in events(worker.log_path, "lease_granted")]
    assert granted.count(first["group_id"]) == 1  # generated once

    # a worker that dies mid-generation renews nothing: its lease is back within the timeout of its last beat
    wait_for(lambda: broker.stats()["leases"]["outstanding"] == 1, 10, "the worker's next lease", procs)
    os.killpg(worker.pid, signal.SIGKILL)
    stats = wait_for(lambda: (s := broker.stats())["leases"]["outstanding"] == 0 and s,
                     LEASE_TIMEOUT_S + 10, "the dead worker's lease back", procs)
    assert stats["prompts"]["queued"] >= 1
