"""The Slurm templates for real: ``sbatch`` of deploy/slurm/loraflow-run.sbatch trains the demo (CURVE on, keys
from one shared directory) on a one-node cluster, a second job of deploy/slurm/loraflow-workers.sbatch joins
the running run, one worker step of the run is ``scancel``-ed (SIGKILL) and another stopped with SIGTERM
mid-run, the learner step is killed (the job starts it again, it resumes from its checkpoint), and the job is
stopped with a SIGTERM to its batch script (``scancel --batch --signal=TERM``). Then the ledger audit of tests/fault: every prompt trained
exactly once, no withdrawn version trained, and the learner's final checkpoint (written on SIGTERM) holds the
whole epoch."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fault.ledger import audit_run
from tests.slurm.cluster import SlurmCluster
from tests.slurm.runs import SLURM, job_waiter, keys_for, log_events, run_env, trained_ids
from tests.support import REPO

pytestmark = pytest.mark.slurm

# 80 steps: training lasts long enough for the scancels, the elastic job and the learner crash to land mid-run
# (with 96 the run once ended before the second scancel)
NUM_PROMPTS = 320


def test_sbatch_run_with_elastic_workers_scancel_and_preemption(slurm_cluster: SlurmCluster, quick_base_dir: Path,
                                                                 tmp_path: Path) -> None:
    cluster = slurm_cluster
    run_dir = tmp_path / "run"
    env = run_env(run_dir, quick_base_dir, keys_for(tmp_path), NUM_PROMPTS)
    logs = run_dir / "slurm" / "logs"
    wait = job_waiter(cluster, tmp_path, run_dir)

    started = time.monotonic()
    job = cluster.sbatch(SLURM / "loraflow-run.sbatch", "--time=10", f"--output={tmp_path / 'run.out'}", env=env,
                         cwd=REPO)
    wait(lambda: cluster.job_state(job) == "RUNNING", 60, "the run job to start")
    shown = cluster.show_job(job)
    assert shown["JobState"] == "RUNNING" and shown["NodeList"] == cluster.node, shown
    assert shown["Requeue"] == "1", shown  # preempted or failed nodes: Slurm requeues it and it resumes
    workers = {f"worker-{cluster.node}-{job}01", f"worker-{cluster.node}-{job}02"}
    wait(lambda: {"broker", "learner"} | workers <= set(cluster.steps(job)), 60, "the run's steps")

    # an elastic job of one more worker, pointed at the run by its run directory
    extra_job = cluster.sbatch(SLURM / "loraflow-workers.sbatch", "--ntasks-per-node=1", "--time=10",
                               f"--output={tmp_path / 'workers.out'}", env=env, cwd=REPO)
    extra_log = logs / f"worker-{cluster.node}-{extra_job}01.log"

    # mid-run, while it holds leases: `scancel <job>.<step>` of one worker step (Slurm SIGKILLs a cancelled step:
    # the broker reclaims its leases), then `scancel --signal=TERM` of the other (it returns its leases and exits)
    killed, stopped = (f"worker-{cluster.node}-{job}0{i}" for i in (1, 2))
    killed_log, stopped_log = logs / f"{killed}.log", logs / f"{stopped}.log"
    wait(lambda: trained_ids(run_dir) and len(log_events(killed_log, "lease_granted"))
         > len(log_events(killed_log, "group_submitted")), 180, "a trained step and a lease on the first worker")
    assert len(trained_ids(run_dir)) < NUM_PROMPTS, "the run ended before the scancel: give it more prompts"
    cluster.run("scancel", cluster.steps(job)[killed])
    wait(lambda: killed not in cluster.steps(job), 60, "the cancelled worker step to end")
    assert not log_events(killed_log, "stopped"), "a cancelled step was expected to be killed, not stopped"
    wait(lambda: any(line.get("peer") == f"worker/{killed.removeprefix('worker-')}"
                     for line in log_events(logs / "broker.log", "peer_dead")), 60, "the broker to reclaim its leases")
    wait(lambda: len(log_events(stopped_log, "lease_granted")) > len(log_events(stopped_log, "group_submitted")), 60,
         "a lease on the second worker")
    cluster.run("scancel", "--signal=TERM", cluster.steps(job)[stopped])
    wait(lambda: stopped not in cluster.steps(job), 60, "the signalled worker step to end")
    assert log_events(stopped_log, "stopped"), f"no clean stop on SIGTERM\n{stopped_log.read_text()[-3000:]}"
    print(f"scancel --signal=TERM of {stopped}: returned {log_events(stopped_log, 'stopped')[-1]['returned']} lease(s)")

    # the elastic job's worker carries the rest of the run
    wait(lambda: log_events(extra_log, "lease_granted"), 180, "the elastic job's worker to lease")
    assert len(trained_ids(run_dir)) < NUM_PROMPTS, "the run ended before the elastic worker joined: more prompts"

    # a learner crash: SIGKILL to its step; the job starts it again and it resumes from its checkpoint
    first_learner = cluster.steps(job)["learner"]
    cluster.run("scancel", "--signal=KILL", first_learner)
    wait(lambda: cluster.steps(job).get("learner", first_learner) != first_learner, 90, "a new learner step")
    assert len(trained_ids(run_dir)) < NUM_PROMPTS, "the run ended before the learner crash: more prompts"
    wait(lambda: len(trained_ids(run_dir)) == NUM_PROMPTS, 240, f"all {NUM_PROMPTS} prompts trained")

    # what the time limit does with --signal=B:TERM@120: SIGTERM to the batch script, which stops the steps in order
    cluster.run("scancel", "--batch", "--signal=TERM", job)
    wait(lambda: not cluster.job_state(job) and not cluster.job_state(extra_job), 180, "both jobs to end")
    done = cluster.completed()
    assert done[job]["JobState"] == "COMPLETED" and done[job]["ExitCode"] == "0:0", done[job]
    assert done[extra_job]["JobState"] == "COMPLETED", done[extra_job]
    for name in ("broker", "learner"):
        assert (logs / f"{name}.log").is_file()
    assert log_events(extra_log, "stopped"), extra_log.read_text()[-3000:]

    audit = audit_run(run_dir, sorted(logs.glob("worker-*.log")), NUM_PROMPTS)
    assert len(audit.starts) == 2, audit.summary()  # the learner step and its restart
    assert audit.worker_events["accepted"] & {line["group_id"] for line in log_events(extra_log, "group_submitted")}, \
        "the elastic job's worker contributed no accepted group"
    print(f"slurm run in {time.monotonic() - started:.0f} s: {audit.summary()}")
