"""`loraflow pool` end to end: one broker, runs submitted while it serves, each its own learner, workers and ledger.

Two runs of one epoch each (24 prompts, 4 groups a step, 6 steps, different seeds, learning rates and group
sizes) on the quick demo base; mid-run the pool's broker is SIGKILLed, then run a's learner. The pool restarts
both; every run completes by itself and passes the audit of tests/fault on its own run directory (every prompt
of its epoch trained exactly once in its committed history, nothing of a withdrawn version trained). A run that
sets what only the pool owns is refused at submit (exit 2, the key named); a third run is cancelled mid-run, a
fourth whose reward fails on every sample is stopped with that reason, and the others go on; ``loraflow runs`` and ``loraflow status --run`` show each run; ctrl-C stops the pool cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from loraflow.deploy import rundir
from tests.fault.ledger import audit_run
from tests.support import Processes, child_env, wait_for

TIMEOUT_S = 300
PROMPTS = 24


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", *args], capture_output=True, text=True,
                          env=child_env(), timeout=60)


def steps_of(run_dir: Path) -> int:
    metrics = rundir.read_jsonl(rundir.metrics_path(run_dir))
    return metrics[-1]["step"] if metrics else 0


def started_pid(run_dir: Path, process: str) -> int | None:
    starts = [e for e in rundir.read_jsonl(rundir.processes_path(run_dir))
              if e["process"] == process and e["event"] == "start"]
    return starts[-1]["pid"] if starts else None


def run_state(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "run_state.json").read_text())["state"]
    except (OSError, ValueError):
        return ""


def test_a_pool_runs_submitted_runs_apart_through_a_killed_broker_and_learner(procs: Processes, tmp_path: Path,
                                                                              quick_base_dir: Path) -> None:
    pool_dir = tmp_path / "pool"
    pool = procs.spawn("pool", [
        sys.executable, "-m", "loraflow.deploy.cli", "pool", "--model", str(quick_base_dir), "--run-dir", str(pool_dir),
        "--workers", "1", "--log-format", "json", "--set", "broker.prompt_limit=24", "--set", "broker.num_epochs=1",
        "--set", "broker.heartbeat_interval_s=0.2", "--set", "launch.restart_backoff_s=0.5",
        "--set", "eval.num_prompts=20", "--set", "eval.every_s=0", "--set", "learner.checkpoint_every=2",
        "--set", "learner.save_adapter_every=2", "--set", "run.groups_per_step=4", "--set", "run.max_staleness=1"])
    wait_for(lambda: (pool_dir / "config.toml").is_file() and started_pid(pool_dir, "broker"), 120, "the pool", procs)

    run_file = tmp_path / "run.toml"
    run_file.write_text("[run]\nnum_steps = 6\n")
    submitted = cli("submit", str(run_file), "--pool", str(pool_dir), "--id", "a", "--set", "run.seed=1",
                    "--set", "learner.lr=2e-3")
    assert (submitted.returncode, submitted.stdout.strip()) == (0, "a"), submitted.stderr
    assert cli("submit", str(run_file), "--pool", str(pool_dir), "--id", "b", "--set", "run.seed=2",
               "--set", "run.group_size=4").returncode == 0
    refused = cli("submit", str(run_file), "--pool", str(pool_dir), "--set", "model.path=elsewhere")
    assert refused.returncode == 2 and "model is the pool's" in refused.stderr, refused.stderr
    endless = tmp_path / "endless.toml"
    endless.write_text("[run]\nnum_steps = 0\nseed = 3\n")
    assert cli("submit", str(endless), "--pool", str(pool_dir), "--id", "c").stdout.strip() == "c"
    failing = cli("submit", str(run_file), "--pool", str(pool_dir), "--id", "d", "--set",
                  'worker.reward="tests.worker.test_reward_failures:always_raises"',
                  "--set", "worker.max_failed_reward_groups=2")
    assert failing.returncode == 0, failing.stderr
    a, b, c, d = (pool_dir / "runs" / name for name in "abcd")

    wait_for(lambda: steps_of(a) >= 2 and steps_of(b) >= 2, TIMEOUT_S, "two steps of runs a and b", procs)
    status = cli("status", str(pool_dir / "config.toml"), "--run", "b", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["settings"]["group_size"] == 4, status.stdout
    os.kill(started_pid(pool_dir, "broker"), signal.SIGKILL)
    checkpoint = a / "learner" / "checkpoints" / "step_00000004" / "learner_state.json"
    wait_for(lambda: steps_of(a) >= 5 and checkpoint.is_file(), TIMEOUT_S, "run a's step 5 after the restart", procs)
    os.kill(started_pid(a, "learner"), signal.SIGKILL)
    wait_for(lambda: steps_of(c) >= 1, TIMEOUT_S, "a step of run c", procs)
    assert cli("cancel", "c", "--pool", str(pool_dir), "--reason", "by the test").returncode == 0

    wait_for(lambda: (run_state(a), run_state(b), run_state(c), run_state(d)) == (
        "finished", "finished", "cancelled", "failed"), TIMEOUT_S, "a and b to finish, c cancelled, d failed", procs)
    rows = {row["run"]: row for row in map(json.loads, cli("runs", "--pool", str(pool_dir), "--json").stdout.splitlines())}
    assert {name: row["state"] for name, row in rows.items()} == {
        "a": "finished", "b": "finished", "c": "cancelled", "d": "failed"}
    assert "every sample of 2 groups in a row failed its reward" in rows["d"]["reason"], rows["d"]
    assert rows["a"]["step"] == rows["b"]["step"] == 6 and rows["c"]["reason"] == "cancelled: by the test"
    pool.signal(signal.SIGINT)
    wait_for(lambda: not pool.alive(), 60, "the pool to stop", procs)
    assert pool.popen.returncode == 0, pool.log()

    out = pool.log()
    assert "broker stopped unexpectedly (signal SIGKILL); restarting" in out
    assert "[a] learner stopped unexpectedly (signal SIGKILL); restarting" in out
    for run_dir in (a, b):
        audit = audit_run(run_dir, [run_dir / "logs" / "worker-1.log"], PROMPTS)
        assert len(audit.chain) == 6, audit.summary()
        trained_from = {worker for step in audit.chain for worker in step["workers"].values()}
        assert trained_from == {f"{run_dir.name}-1"}, trained_from  # only its own run's worker, as the broker names it
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stop_reason"] == "run.num_steps (6) reached" and summary["final_version"] >= 6
        assert (run_dir / "final_adapter" / "adapter_model.safetensors").is_file()
    assert len(audit_run(a, [a / "logs" / "worker-1.log"], PROMPTS).starts) == 2  # a's learner resumed once
    assert json.loads((c / "summary.json").read_text())["stop_reason"] == "cancelled: by the test"
    assert sorted(p.name for p in (pool_dir / "runs").iterdir()) == ["a", "b", "c", "d"]
