"""The learner with the real broker and a scripted producer: it trains, publishes versions in order, acks batches."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.learner.scripted import Producer
from tests.support import REPO, Processes, child_env, start_broker, wait_for

NUM_STEPS = 4
# the Producer's groups have made-up log-probs and no evidence, which the policy check refuses (its tests:
# tests/learner/test_integrity_check.py)
RUN = ["run.groups_per_step=2", "run.group_size=4", "run.max_staleness=1", "broker.heartbeat_interval_s=0.2",
       "integrity.check=false"]


def test_learner_trains_with_the_real_broker(tiny_model_dir: Path, procs: Processes, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    model = f"model.path=\"{tiny_model_dir}\""
    broker = start_broker(procs, *RUN, model, run_dir=run_dir)
    producer = Producer(broker.endpoint)
    producer.start()
    args = ["--run-dir", str(run_dir), "--endpoint", broker.endpoint, "--num-steps", str(NUM_STEPS)]
    for override in (*RUN, model, "learner.lora_rank=4", "learner.save_adapter_every=0"):
        args += ["--set", override]
    learner = procs.python("learner", "loraflow.learner", *args)
    try:
        assert learner.wait(120) == 0, procs.logs()
        wait_for(lambda: producer.notices[-1:] == [NUM_STEPS], 10, "the last adapter notice", procs)
        stats = broker.stats()
    finally:
        producer.stop.set()
        producer.join(timeout=10)
    assert producer.notices == list(range(1, NUM_STEPS + 1))  # every version, in order, relayed to workers
    assert not [e for e in producer.errors if e.code != "limit"], producer.errors
    assert stats["latest_version"] == NUM_STEPS
    assert stats["prompts"]["trained_total"] == NUM_STEPS * 2  # every batch acknowledged, every group trained
    lines = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in lines] == list(range(1, NUM_STEPS + 1))
    assert all(m["num_groups"] == 2 and m["num_tokens"] > 0 for m in lines)
    assert all(max(int(k) for k in m["staleness"]) <= 1 for m in lines if m["staleness"])
    assert (run_dir / "learner" / "adapters" / f"v{NUM_STEPS:06d}" / "adapter_config.json").is_file()
    assert "unacknowledged_at_exit" not in learner.log()


@pytest.mark.parametrize("how", ["process", "torchrun"])
def test_a_learner_replaced_by_another_is_fenced_and_exits_4(tiny_model_dir: Path, procs: Processes,
                                                             tmp_path: Path, how: str) -> None:
    """Two learners against one broker: the newest wins, the first is refused from then on and stops with
    EXIT_REPLACED (which the supervisor and the systemd unit do not restart), naming its successor. Under
    torchrun (2 ranks, started by the systemd unit's script) the script passes rank 0's 4 on, not torchrun's 1."""
    from loraflow.common.cli import EXIT_REPLACED
    from loraflow.common.config import load_config
    from loraflow.common.metrics import Metrics
    from loraflow.learner.session import BrokerSession

    run_dir = tmp_path / "run"
    model = f"model.path=\"{tiny_model_dir}\""
    broker = start_broker(procs, *RUN, model, run_dir=run_dir)
    producer = Producer(broker.endpoint)
    producer.start()
    overrides = (*RUN, model, "learner.lora_rank=4", "learner.save_adapter_every=0", "learner.num_threads=1")
    args = ["--run-dir", str(run_dir), "--endpoint", broker.endpoint, "--num-steps", "0"]
    for override in overrides:
        args += ["--set", override]
    if how == "process":
        learner = procs.python("learner", "loraflow.learner", *args)
    else:
        config = tmp_path / "run.toml"
        config.touch()
        env = child_env(LORAFLOW_HOME=str(REPO), LORAFLOW_VENV=str(Path(sys.executable).parent.parent),
                        LORAFLOW_CONFIG=str(config), LORAFLOW_RUN_DIR=str(run_dir), LORAFLOW_ENDPOINT=broker.endpoint,
                        LORAFLOW_LEARNER_NPROC="2", LORAFLOW_EXTRA_ARGS=" ".join(args[4:]))
        learner = procs.spawn("learner", [str(REPO / "deploy" / "scripts" / "learner.sh")], env=env)
    successor = None
    try:
        wait_for(lambda: producer.notices, 180, "the first learner's first adapter", procs)
        config = load_config(None, [f"broker.endpoint=\"{broker.endpoint}\"", f'run.run_dir="{run_dir}"', *RUN])
        successor = BrokerSession(config, version=producer.notices[-1], metrics=Metrics(), client_id="learner")
        successor.start(10)
        assert learner.wait(60) == EXIT_REPLACED, procs.logs()
        assert "learner_replaced" in learner.log() and f"pid {os.getpid()}" in learner.log()
        stats = broker.stats()
        assert stats["learner"]["session"] == successor.link.hello.session
        assert stats["rejected"]["replaced"] >= 1
    finally:
        producer.stop.set()
        producer.join(timeout=10)
        if successor is not None:
            successor.close()
