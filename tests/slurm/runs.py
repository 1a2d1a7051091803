"""What the Slurm run tests share: the environment sbatch passes on for a small demo run, keys made the way an
operator makes them, a waiter that shows every role's log on timeout, and reads of the run's ledger and logs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraflow.learner.ledger import read as read_ledger
from tests.fault.ledger import committed_chain, read_json_lines
from tests.slurm.cluster import SlurmCluster, free_port
from tests.support import REPO, wait_for

SLURM = REPO / "deploy" / "slurm"
VENV = Path(sys.executable).parent.parent


def run_env(run_dir: Path, base_dir: Path, keys_dir: Path, num_prompts: int) -> dict[str, str]:
    """The environment sbatch passes on: the demo config on ``base_dir``, a single epoch of ``num_prompts``,
    small steps, JSON logs (the audit reads the workers'), CURVE with the keys in ``keys_dir``."""
    overrides = {
        "model.path": f'"{base_dir}"', "broker.prompt_limit": num_prompts, "broker.num_epochs": 1,
        "broker.heartbeat_interval_s": 0.2, "broker.lease_timeout_s": 20, "run.group_size": 4,
        "run.groups_per_step": 4, "run.max_staleness": 1, "worker.capacity": 2, "learner.checkpoint_every": 4,
        "learner.batch_wait_ms": 200, "learner.lora_rank": 4,
    }
    extra = " ".join(f"--set {key}={value}" for key, value in overrides.items()) + " --log-format json"
    return {"LORAFLOW_HOME": str(REPO), "LORAFLOW_VENV": str(VENV), "LORAFLOW_RUN_DIR": str(run_dir),
            "LORAFLOW_CONFIG": str(REPO / "deploy" / "configs" / "demo.toml"), "LORAFLOW_KEYS_DIR": str(keys_dir),
            "LORAFLOW_BIND": "tcp://127.0.0.1:0", "LORAFLOW_SLURM_WORKERS_PER_NODE": "2",
            "LORAFLOW_EXTRA_ARGS": extra, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1"}


def trained_ids(run_dir: Path) -> set[str]:
    path = run_dir / "learner" / "ledger.jsonl"
    if not path.is_file():
        return set()
    chain, _ = committed_chain(read_ledger(path))
    return {g for step in chain for g in step["trained"] + step["zero_variance"]}


def keys_for(tmp_path: Path) -> Path:
    """Keys made the way an operator makes them (`loraflow keys DIR`), in the directory every step reads."""
    keys_dir = tmp_path / "keys"
    subprocess.run([str(VENV / "bin" / "loraflow"), "keys", str(keys_dir)], check=True, capture_output=True,
                   timeout=60)
    return keys_dir


def job_waiter(cluster: SlurmCluster, tmp_path: Path, run_dir: Path) -> Callable[..., Any]:
    """``wait(condition, timeout_s, what)`` that shows the job's and the roles' logs and the daemons' on timeout."""
    logs = run_dir / "slurm" / "logs"

    def job_logs() -> str:
        files = [*sorted(tmp_path.glob("*.out")), *sorted(logs.glob("*.log"))]
        return "\n".join(f"----- {p.name} -----\n{p.read_text(errors='replace')[-3000:]}" for p in files if p.is_file())

    def wait(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
        try:
            return wait_for(condition, timeout_s, what, interval_s=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{job_logs()}\n{cluster.daemon_logs()}") from None

    wait.logs = job_logs  # type: ignore[attr-defined]  # for a failed assertion after the waits
    return wait


def log_events(path: Path, event: str) -> list[dict]:
    return [line for line in read_json_lines(path) if line.get("event") == event] if path.is_file() else []
