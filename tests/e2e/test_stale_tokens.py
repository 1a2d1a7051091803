"""A real run (broker, one sim worker, the learner on the tiny model) where long samples span adapter versions:
they are trained with their tokens older than max_staleness masked, not dropped (issue 13, common/versions.py).

With max_staleness 1, the ``continue`` policy and long-tailed lengths, a long sample still generating while the
learner publishes two versions ends with tokens of three. Its group reaches the learner (its newest token is
recent) and is trained, its tokens older than the bound counted in ``tokens_masked_stale``; the step's
``staleness`` (a group's newest token's) stays within the bound. Before issue 13 such a group was dropped and
generated again.
"""

from __future__ import annotations

import json
from pathlib import Path

from loraflow.learner.ledger import read as read_ledger
from tests.fault.system import HEARTBEAT_S, System
from tests.support import Processes, wait_for


def write_config(path: Path, run_dir: Path, model_dir: Path) -> Path:
    path.write_text(f"""
[run]
run_dir = "{run_dir}"
group_size = 4
groups_per_step = 2
max_staleness = 1
log_format = "json"
[model]
path = "{model_dir}"
[broker]
prompt_limit = 400
num_epochs = 1
heartbeat_interval_s = {HEARTBEAT_S}
lease_timeout_s = 60
[worker]
backend = "sim"
partial_policy = "continue"
capacity = 4
num_threads = 1
reward = "tests.fault.rewards:coin"
max_new_tokens = 192
chunk_tokens = 4
[worker.sim]
tokens_per_s = 100
mean_tokens = 16
length_sigma = 1.2
max_tokens = 192
[learner]
lora_rank = 4
checkpoint_every = 0
save_adapter_every = 0
num_threads = 1
batch_wait_ms = 200
[integrity]
check = false
""")
    return path


def test_a_sample_spanning_versions_is_trained_with_its_stale_tokens_masked(procs: Processes, tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    system = System(procs, write_config(tmp_path / "run.toml", run_dir, tiny_model_dir), run_dir, num_workers=1)
    system.start()
    metrics = run_dir / "learner" / "metrics.jsonl"

    def masked_step() -> dict | None:
        lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        return next((m for m in lines if m["tokens_masked_stale"] > 0), None)

    step = wait_for(masked_step, 180, "a step that trained a group with stale tokens masked", procs, interval_s=0.2)
    system.stop()
    assert max(int(k) for k in step["staleness"]) <= 1 and step["num_tokens"] > 0, step
    # the learner's ledger: that step trained a group holding tokens past the bound (not dropped) and within it
    line = next(x for x in read_ledger(run_dir / "learner" / "ledger.jsonl")
                if x["event"] == "step" and x["step"] == step["step"])
    oldest = line["trained_version"] - 1
    spanning = [g for g in line["trained"] if min(line["versions"][g]) < oldest <= max(line["versions"][g])]
    assert spanning, line
