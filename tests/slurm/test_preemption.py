"""Preemption and the time limit for real: the run job sits in a preemptible partition; a job of a higher-priority partition that
needs the whole node preempts it. Slurm sends every step SIGTERM (the learner finishes its step and
checkpoints, the workers return their leases, the broker writes its state), requeues the job, and runs it again
when the node is free: same job id, same run directory, so the broker resumes from its state, the learner from
its checkpoint and the workers under their old ids. Then the time limit's warning (SIGUSR1 to the batch script,
what ``--signal=B:USR1@120`` sends) makes the job stop in order and requeue itself once more. The run then
finishes its epoch and the ledger audit holds (every prompt exactly once, nothing of a withdrawn version
trained) across the three incarnations."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fault.ledger import audit_run
from tests.slurm.cluster import SlurmCluster
from tests.slurm.runs import SLURM, job_waiter, keys_for, run_env, trained_ids
from tests.support import REPO, wait_for

pytestmark = pytest.mark.slurm

NUM_PROMPTS = 96  # 24 steps: enough left for the preemption and the USR1 to land mid-run


def test_preempted_run_is_requeued_and_resumes(slurm_cluster: SlurmCluster, quick_base_dir: Path,
                                               tmp_path: Path) -> None:
    cluster = slurm_cluster
    run_dir = tmp_path / "run"
    env = run_env(run_dir, quick_base_dir, keys_for(tmp_path), NUM_PROMPTS)
    wait = job_waiter(cluster, tmp_path, run_dir)
    started = time.monotonic()
    job = cluster.sbatch(SLURM / "loraflow-run.sbatch", "--partition=test", "--time=10",
                         f"--output={tmp_path / 'run.out'}", env=env, cwd=REPO)
    ledger = run_dir / "learner" / "ledger.jsonl"
    wait(lambda: ledger.is_file() and ledger.read_text().count('"event":"step"') >= 3, 180, "three learner steps")
    before = len(trained_ids(run_dir))
    assert before < NUM_PROMPTS, "the run ended before the preemption: give it more prompts"

    urgent_script = tmp_path / "urgent.sh"
    urgent_script.write_text("#!/bin/sh\nsleep 3\n")
    urgent = cluster.sbatch(urgent_script, "--partition=urgent", f"--ntasks={cluster.cpus}", "--time=2",
                            f"--output={tmp_path / 'urgent.out'}")
    wait(lambda: int(cluster.show_job(job).get("Restarts", "0")) >= 1, 120, "the run job to be preempted and requeued")
    wait(lambda: not cluster.job_state(urgent), 120, "the urgent job to run and end")
    release(cluster, job)
    wait(lambda: cluster.job_state(job) == "RUNNING", 120, "the requeued run job to start again")

    # then the time limit's warning, `--signal=B:USR1@120`, sent by hand: an ordered stop and a requeue
    target = ledger.read_text().count('"event":"step"') + 3
    wait(lambda: ledger.read_text().count('"event":"step"') >= target, 180, "three more learner steps")
    middle = len(trained_ids(run_dir))
    assert middle < NUM_PROMPTS, "the run ended before the USR1: give it more prompts"
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    wait(lambda: int(cluster.show_job(job).get("Restarts", "0")) >= 2, 120, "the run job to requeue itself")
    release(cluster, job)
    wait(lambda: cluster.job_state(job) == "RUNNING", 120, "the run job to start a third time")
    wait(lambda: len(trained_ids(run_dir)) == NUM_PROMPTS, 300, f"all {NUM_PROMPTS} prompts trained")
    # the prompts may all be trained before the third learner is up (the USR1's last steps): stop a running one
    wait(lambda: ledger.read_text().count('"event":"start"') >= 3, 120, "the third learner to start")
    cluster.run("scancel", "--batch", "--signal=TERM", job)
    wait(lambda: not cluster.job_state(job), 180, "the run job to end")
    state = cluster.completed()[job]
    assert state["JobState"] == "COMPLETED", f"{state}\n{wait.logs()}"

    logs = run_dir / "slurm" / "logs"
    audit = audit_run(run_dir, sorted(logs.glob("worker-*.log")), NUM_PROMPTS)
    assert len(audit.starts) == 3, audit.summary()  # one learner per incarnation of the job
    run_out = (tmp_path / "run.out").read_text()
    assert "asked to stop" in run_out and run_out.count("requeueing") == 2, run_out
    print(f"preempted after {before} prompts, USR1 after {middle}; slurm run in {time.monotonic() - started:.0f} s: "
          f"{audit.summary()}")


def release(cluster: SlurmCluster, job: str) -> None:
    """Slurm holds a requeued job back until its BeginTime (about two minutes on): let it start now, once its
    last incarnation is gone from the node and a second has passed (slurmd revokes the job's credentials at the
    requeue, with one-second resolution: a launch in that second is refused, "Job credential revoked")."""
    wait_for(lambda: cluster.job_state(job) == "PENDING"
             and cluster.run("sinfo", "--noheader", "--format=%T", check=False).strip() == "idle", 120,
             "the requeued job to be pending on an idle node")
    time.sleep(2)
    pending = cluster.show_job(job)
    print(f"requeued: JobState={pending['JobState']} Reason={pending.get('Reason')} "
          f"EligibleTime={pending.get('EligibleTime')}")
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
