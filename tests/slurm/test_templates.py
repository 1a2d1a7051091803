"""The Slurm templates' layout without daemons: with LORAFLOW_DRY_RUN=1 they print the srun steps they would
start for a given allocation (``scontrol show hostnames`` expands the node list), and step.sh maps a task's
Slurm environment onto the role scripts (which print their commands in a dry run too)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, child_env

pytestmark = pytest.mark.slurm

SLURM = REPO / "deploy" / "slurm"
VENV = Path(sys.executable).parent.parent


def dry_run(template: str, tmp_path: Path, slurm_conf: dict[str, str], **env: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.toml"
    config.touch()
    full = child_env(LORAFLOW_HOME=str(REPO), LORAFLOW_VENV=str(VENV), LORAFLOW_CONFIG=str(config),
                     LORAFLOW_RUN_DIR=str(tmp_path / "run"), LORAFLOW_DRY_RUN="1", SLURM_JOB_ID="77", **slurm_conf,
                     **env)
    return subprocess.run(["bash", str(SLURM / template)], env=full, capture_output=True, text=True, timeout=60)


def steps(output: str) -> dict[str, list[str]]:
    """srun command lines by step name."""
    out = {}
    for line in output.splitlines():
        argv = shlex.split(line)
        if argv and argv[0] == "srun":
            name = next(a.split("=", 1)[1] for a in argv if a.startswith("--job-name="))
            out[name] = argv
    return out


def test_run_template_lays_out_broker_learner_nodes_and_gpu_workers(tmp_path: Path,
                                                                    slurm_conf_only: dict[str, str]) -> None:
    result = dry_run("loraflow-run.sbatch", tmp_path, slurm_conf_only, SLURM_JOB_NODELIST="n[1-4]",
                     LORAFLOW_LEARNER_NNODES="2", LORAFLOW_SLURM_WORKERS_PER_NODE="2",
                     LORAFLOW_SLURM_GPUS_PER_WORKER="1", LORAFLOW_SLURM_LEARNER_GPUS="8", MASTER_PORT="29511")
    assert result.returncode == 0, result.stderr
    found = steps(result.stdout)
    assert set(found) == {"broker", "learner", "worker-n3-7701", "worker-n3-7702", "worker-n4-7703", "worker-n4-7704"}
    assert "--nodelist=n1" in found["broker"] and "--overlap" in found["broker"]
    learner = found["learner"]
    assert {"--nodes=2", "--ntasks-per-node=1", "--gres=gpu:8", "--nodelist=n1,n2"} <= set(learner)
    assert learner[-2:] == [str(SLURM / "step.sh"), "learner"]
    for name, node in (("worker-n3-7701", "n3"), ("worker-n4-7704", "n4")):
        assert {"--exact", "--gres=gpu:1", f"--nodelist={node}", "--ntasks=1"} <= set(found[name])
        assert f"--output={tmp_path}/run/slurm/logs/{name}.log" in found[name]
    assert "rendezvous n1:29511" in result.stderr and "broker at tcp://n1:5555" in result.stderr
    assert (tmp_path / "run" / "slurm" / "endpoint").read_text().strip() == "tcp://n1:5555"


def test_run_template_on_one_node_puts_workers_beside_the_learner(tmp_path: Path,
                                                                  slurm_conf_only: dict[str, str]) -> None:
    result = dry_run("loraflow-run.sbatch", tmp_path, slurm_conf_only, SLURM_JOB_NODELIST="n5")
    assert result.returncode == 0, result.stderr
    found = steps(result.stdout)
    assert set(found) == {"broker", "learner", "worker-n5-7701"}
    assert not any(a.startswith("--gres") for argv in found.values() for a in argv)  # the CPU variant


def test_run_template_refuses_more_learner_nodes_than_the_job_has(tmp_path: Path,
                                                                  slurm_conf_only: dict[str, str]) -> None:
    result = dry_run("loraflow-run.sbatch", tmp_path, slurm_conf_only, SLURM_JOB_NODELIST="n[1-2]",
                     LORAFLOW_LEARNER_NNODES="3")
    assert result.returncode == 2 and "LORAFLOW_LEARNER_NNODES=3" in result.stderr and "--nodes" in result.stderr


def test_worker_job_needs_the_run_and_takes_its_endpoint(tmp_path: Path, slurm_conf_only: dict[str, str]) -> None:
    missing = dry_run("loraflow-workers.sbatch", tmp_path, slurm_conf_only, SLURM_JOB_NODELIST="n[7-8]",
                      SLURM_NTASKS_PER_NODE="3")
    assert missing.returncode == 2 and "slurm/endpoint" in missing.stderr
    (tmp_path / "run" / "slurm").mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "slurm" / "endpoint").write_text("tcp://n1:5555\n")
    result = dry_run("loraflow-workers.sbatch", tmp_path, slurm_conf_only, SLURM_JOB_NODELIST="n[7-8]",
                     SLURM_NTASKS_PER_NODE="3(x2)")
    assert result.returncode == 0, result.stderr
    assert set(steps(result.stdout)) == {f"worker-n{n}-770{i}" for n, i in
                                         ((7, 1), (7, 2), (7, 3), (8, 4), (8, 5), (8, 6))}
    assert "joining tcp://n1:5555" in result.stderr
    assert (tmp_path / "run" / "slurm" / "worker-jobs" / "77").is_file()  # the run job stops it first


def test_step_script_maps_the_task_rank_onto_the_learner_node_rank(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.touch()
    env = child_env(LORAFLOW_HOME=str(REPO), LORAFLOW_VENV=str(VENV), LORAFLOW_CONFIG=str(config),
                    LORAFLOW_RUN_DIR=str(tmp_path / "run"), LORAFLOW_DRY_RUN="1", SLURM_PROCID="1",
                    LORAFLOW_LEARNER_NNODES="2", LORAFLOW_LEARNER_NPROC="4", LORAFLOW_RDZV_ENDPOINT="n1:29500",
                    LORAFLOW_ENDPOINT="tcp://n1:5555")
    learner = subprocess.run([str(SLURM / "step.sh"), "learner"], env=env, capture_output=True, text=True, timeout=30)
    assert learner.returncode == 0, learner.stderr
    assert ("--nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv_backend=c10d --rdzv_endpoint=n1:29500"
            in learner.stdout)
    worker = subprocess.run([str(SLURM / "step.sh"), "worker", "7702"], env=env, capture_output=True, text=True,
                            timeout=30)
    assert worker.returncode == 0 and "-7702" in worker.stdout and "--endpoint tcp://n1:5555" in worker.stdout
    assert subprocess.run([str(SLURM / "step.sh"), "nope"], env=env, capture_output=True, timeout=30).returncode == 2


def test_templates_ask_for_the_time_limit_warning_the_scripts_handle() -> None:
    """The run job gets SIGUSR1 120 s before its limit (it stops and requeues itself, tests/slurm/test_preemption.py)
    and may be requeued; the worker job gets SIGTERM 60 s before (its workers return their leases)."""
    def directives(name: str) -> list[str]:
        return [line.split(None, 1)[1] for line in (SLURM / name).read_text().splitlines() if line.startswith("#SBATCH")]

    assert {"--signal=B:USR1@120", "--requeue"} <= set(directives("loraflow-run.sbatch"))
    assert "--signal=B:TERM@60" in directives("loraflow-workers.sbatch")
