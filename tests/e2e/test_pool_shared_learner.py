"""`loraflow pool --shared-workers 1 --shared-learner`: one worker process and one learner process for every run.

Three runs of one epoch each (24 prompts, 6 steps) with their own LoRA rank, learning rate, group size and seed,
and a fourth whose ``learner.target_modules`` selects nothing, all trained by one learner process over one frozen
base (a thread per run; learner/pool_learner.py) and served by one shared worker. While the three train, the
shared learner is SIGKILLed; the pool restarts it and each run resumes from its own checkpoint. Each of the three
passes the audit of tests/fault on its own run directory (every prompt of its epoch trained exactly once, nothing
lost), every run's policy held the one base (``shares_base``) with its own LoRA tensors, each final adapter has
its run's rank, and the fourth run fails alone with its reason.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tests.e2e.test_pool import cli, run_state, started_pid, steps_of
from tests.fault.ledger import audit_run, read_json_lines
from tests.support import Processes, wait_for

TIMEOUT_S = 300
PROMPTS = 24
RANKS = {"a": 16, "b": 4, "c": 8}


def test_one_shared_learner_trains_four_runs_through_a_kill_of_itself(procs: Processes, tmp_path: Path,
                                                                     quick_base_dir: Path) -> None:
    pool_dir = tmp_path / "pool"
    pool = procs.spawn("pool", [
        sys.executable, "-m", "loraflow.deploy.cli", "pool", "--model", str(quick_base_dir), "--run-dir",
        str(pool_dir), "--shared-workers", "1", "--shared-learner", "--log-format", "json",
        "--set", "broker.prompt_limit=24", "--set", "broker.num_epochs=1", "--set", "broker.heartbeat_interval_s=0.2",
        "--set", "launch.restart_backoff_s=0.5", "--set", "eval.num_prompts=0", "--set", "worker.capacity=2",
        "--set", "learner.checkpoint_every=2", "--set", "run.groups_per_step=4", "--set", "run.max_staleness=1"])
    wait_for(lambda: started_pid(pool_dir, "learner-shared"), 120, "the pool's shared learner", procs)
    run_file = tmp_path / "run.toml"
    run_file.write_text("[run]\nnum_steps = 6\n")
    settings = {"a": ["run.seed=1", "learner.lr=2e-3"], "b": ["run.seed=2", "run.group_size=4"],
                "c": ["run.seed=3", "learner.lr=5e-4"], "d": ['learner.target_modules=["no_such_module"]']}
    for name, sets in settings.items():
        rank = [f"learner.lora_rank={RANKS[name]}"] if name in RANKS else []
        assert cli("submit", str(run_file), "--pool", str(pool_dir), "--id", name,
                   *(arg for s in [*sets, *rank] for arg in ("--set", s))).returncode == 0
    a, b, c, d = (pool_dir / "runs" / name for name in "abcd")

    wait_for(lambda: all(steps_of(r) >= 2 for r in (a, b, c)), TIMEOUT_S, "two steps of runs a, b and c", procs)
    os.kill(started_pid(pool_dir, "learner-shared"), signal.SIGKILL)
    wait_for(lambda: tuple(map(run_state, (a, b, c, d))) == ("finished", "finished", "finished", "failed"),
             TIMEOUT_S, "a, b and c to finish, d to fail", procs)
    rows = {r["run"]: r for r in map(json.loads, cli("runs", "--pool", str(pool_dir), "--json").stdout.splitlines())}
    assert "no_such_module" in rows["d"]["reason"], rows["d"]
    assert rows["a"]["step"] == rows["b"]["step"] == rows["c"]["step"] == 6
    pool.signal(signal.SIGINT)
    wait_for(lambda: not pool.alive(), 60, "the pool to stop", procs)
    assert pool.popen.returncode == 0, pool.log()
    assert "learner-shared stopped unexpectedly (signal SIGKILL); restarting" in pool.log()

    learner_log = pool_dir / "logs" / "learner-shared.log"
    lines = read_json_lines(learner_log)
    trained = [line for line in lines if line.get("event") == "run_trained"]
    assert {line["run"] for line in trained} == {"a", "b", "c"} and all(line["shares_base"] for line in trained)
    assert not any(line.get("event") == "policy_mismatch" for line in lines)
    shared_log = pool_dir / "logs" / "worker-shared-1.log"
    for run_dir in (a, b, c):
        audit = audit_run(run_dir, [shared_log], PROMPTS, run=run_dir.name)
        assert len(audit.chain) == 6, audit.summary()
        assert len(audit.starts) == 2, audit.summary()  # its learner resumed once, from its own checkpoint
        adapter = json.loads((run_dir / "final_adapter" / "adapter_config.json").read_text())
        assert adapter["r"] == RANKS[run_dir.name], adapter
        assert not (run_dir / "logs" / "learner.log").exists()  # no learner process of its own
