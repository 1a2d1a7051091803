"""`loraflow pool --shared-workers 1`: one worker process, one engine, serving every run of the pool.

Three runs of one epoch each (24 prompts, 6 steps, different seeds, learning rates, group sizes and sampling)
and a fourth whose reward fails on every sample, all served by one shared worker (a thread per run over one hf
engine; rollout_worker/pool_worker.py). While the four are active the shared worker is SIGKILLed, then the
pool's broker, then the learner of the run furthest from its end; the pool restarts each. Each of the three runs passes the audit of
tests/fault on its own run directory from the shared worker's log lines of that run (every prompt of its epoch
trained exactly once, nothing lost, nothing of a withdrawn version trained); every trained group came from the
shared worker and no group was refused for its evidence (``policy_mismatch``: a token served by another run's
adapter would carry that adapter's sha256). The failing run is stopped with its reason and the others go on;
each run's versions are its own (v1.. in each lineage).

Two runs whose rewards are opposite (short completions paid in one, long ones in the other), on one shared
worker and one shared learner (learner/pool_learner.py): each run's reward rises towards its own maximum.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from loraflow.deploy import rundir
from tests.e2e.test_pool import cli, run_state, started_pid, steps_of
from tests.fault.ledger import audit_run
from tests.support import Processes, wait_for

TIMEOUT_S = 300
PROMPTS = 24
OPPOSITE_STEPS = 20


def test_one_shared_worker_serves_four_runs_through_kills_of_itself_the_broker_and_a_learner(procs: Processes, tmp_path: Path,
                                                                 quick_base_dir: Path) -> None:
    pool_dir = tmp_path / "pool"
    pool = procs.spawn("pool", [
        sys.executable, "-m", "loraflow.deploy.cli", "pool", "--model", str(quick_base_dir), "--run-dir",
        str(pool_dir), "--shared-workers", "1", "--log-format", "json", "--set", "broker.prompt_limit=24",
        "--set", "broker.num_epochs=1", "--set", "broker.heartbeat_interval_s=0.2",
        "--set", "launch.restart_backoff_s=0.5", "--set", "eval.num_prompts=0", "--set", "worker.capacity=2",
        "--set", "learner.checkpoint_every=2", "--set", "run.groups_per_step=4", "--set", "run.max_staleness=1"])
    wait_for(lambda: started_pid(pool_dir, "worker-shared-1"), 120, "the pool's shared worker", procs)
    run_file = tmp_path / "run.toml"
    run_file.write_text("[run]\nnum_steps = 6\n")
    assert cli("submit", str(run_file), "--pool", str(pool_dir), "--id", "a", "--set", "run.seed=1",
               "--set", "learner.lr=2e-3").returncode == 0
    assert cli("submit", str(run_file), "--pool", str(pool_dir), "--id", "b", "--set", "run.seed=2",
               "--set", "run.group_size=4", "--set", "worker.temperature=0.8").returncode == 0
    assert cli("submit", str(run_file), "--pool", str(pool_dir), "--id", "c", "--set", "run.seed=3",
               "--set", "learner.lr=5e-4").returncode == 0
    assert cli("submit", str(run_file), "--pool", str(pool_dir), "--id", "d", "--set",
               'worker.reward="tests.worker.test_reward_failures:always_raises"',
               "--set", "worker.max_failed_reward_groups=2").returncode == 0
    a, b, c, d = (pool_dir / "runs" / name for name in "abcd")

    wait_for(lambda: started_pid(d, "learner") and all(steps_of(r) >= 1 for r in (a, b, c)), TIMEOUT_S,
             "a step of runs a, b and c with d started", procs)
    os.kill(started_pid(pool_dir, "worker-shared-1"), signal.SIGKILL)
    wait_for(lambda: all(steps_of(r) >= 2 for r in (a, b, c)), TIMEOUT_S, "two steps of a, b and c", procs)
    os.kill(started_pid(pool_dir, "broker"), signal.SIGKILL)
    wait_for(lambda: all(steps_of(r) >= 3 for r in (a, b, c)), TIMEOUT_S, "a step of each after the broker", procs)
    victim = min((a, b, c), key=steps_of)  # the run furthest from its end: its learner is surely still running
    os.kill(started_pid(victim, "learner"), signal.SIGKILL)
    wait_for(lambda: tuple(map(run_state, (a, b, c, d))) == ("finished", "finished", "finished", "failed"),
             TIMEOUT_S, "a, b and c to finish, d to fail", procs)
    rows = {r["run"]: r for r in map(json.loads, cli("runs", "--pool", str(pool_dir), "--json").stdout.splitlines())}
    assert "every sample of 2 groups in a row failed its reward" in rows["d"]["reason"], rows["d"]
    assert rows["a"]["step"] == rows["b"]["step"] == rows["c"]["step"] == 6
    pool.signal(signal.SIGINT)
    wait_for(lambda: not pool.alive(), 60, "the pool to stop", procs)
    assert pool.popen.returncode == 0, pool.log()
    for restarted in ("worker-shared-1", "broker", f"[{victim.name}] learner"):
        assert f"{restarted} stopped unexpectedly (signal SIGKILL); restarting" in pool.log()

    shared_log = pool_dir / "logs" / "worker-shared-1.log"
    for run_dir in (a, b, c):
        audit = audit_run(run_dir, [shared_log], PROMPTS, run=run_dir.name)
        assert len(audit.chain) == 6, audit.summary()
        trained_from = {worker for step in audit.chain for worker in step["workers"].values()}
        assert trained_from == {"shared-1"}, trained_from
        learner_log = (run_dir / "logs" / "learner.log").read_text()
        assert "policy_mismatch" not in learner_log  # every token's evidence is this run's own adapter
        assert not list((run_dir / "workers").glob("*/failed"))
        summary = json.loads((run_dir / "summary.json").read_text())
        assert 6 <= summary["final_version"] < 1 << 20  # its own lineage, numbered from 1 (not an engine version)
    served = [json.loads(line) for line in shared_log.read_text().splitlines() if '"run_served"' in line]
    assert {line["run"] for line in served} >= {"a", "b", "c", "d"} and len({line["run_slot"] for line in served}) >= 4
    assert len(audit_run(victim, [shared_log], PROMPTS, run=victim.name).starts) == 2  # its learner resumed once


def mean_reward(run_dir: Path, steps: slice) -> float:
    committed = rundir.learner_history(rundir.read_jsonl(rundir.metrics_path(run_dir))).committed
    rewards = [line["reward_mean"] for line in committed[steps]]
    return sum(rewards) / len(rewards)


def test_two_runs_with_opposite_rewards_each_learn_their_own(procs: Processes, tmp_path: Path,
                                                             quick_base_dir: Path) -> None:
    """One run is paid for short completions, the other for long ones (tests/e2e/pool_rewards.py), both served by
    one shared worker from one engine and trained by one shared learner over one base: each run's reward rises,
    so each trained its own adapter on its own samples (one adapter, or samples of the other run's, could not
    raise both)."""
    pool_dir = tmp_path / "pool"
    procs.spawn("pool", [
        sys.executable, "-m", "loraflow.deploy.cli", "pool", "--model", str(quick_base_dir), "--run-dir",
        str(pool_dir), "--shared-workers", "1", "--shared-learner", "--log-format", "json", "--set",
        "eval.num_prompts=0", "--set", "worker.capacity=2", "--set", "worker.max_new_tokens=16", "--set", "run.groups_per_step=4",
        "--set", "run.max_staleness=1"])
    wait_for(lambda: started_pid(pool_dir, "worker-shared-1"), 120, "the pool's shared worker", procs)
    run_file = tmp_path / "run.toml"
    run_file.write_text(f"[run]\nnum_steps = {OPPOSITE_STEPS}\n[learner]\nlr = 5e-3\n")
    for name in ("short", "long"):
        assert cli("submit", str(run_file), "--pool", str(pool_dir), "--id", name,
                   "--set", f'worker.rewards=["tests.e2e.pool_rewards:{name}"]').returncode == 0
    runs = [pool_dir / "runs" / name for name in ("short", "long")]
    wait_for(lambda: all(run_state(r) == "finished" for r in runs), TIMEOUT_S, "both runs to finish", procs)
    for run_dir in runs:
        first, last = mean_reward(run_dir, slice(0, 3)), mean_reward(run_dir, slice(-3, None))
        # at least 40 % of the way to the most it can be paid (1.0); measured: short 0.77 -> 0.93, long 0.24 -> 0.99
        assert last >= first + 0.4 * (1.0 - first), f"run {run_dir.name}: reward {first:.2f} over its first 3 " \
                                                    f"steps, {last:.2f} over its last 3"
