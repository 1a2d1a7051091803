"""`loraflow run` end to end: the launcher starts a broker, two hf workers and a learner as real processes.

1. A shortened demo: versions advance, every trained group was within max_staleness, rewards are finite, the
   final adapter loads with peft, the run directory holds what the README promises.
2. Synchronous mode with a worker killed (SIGKILL) mid-run: the launcher restarts it, the run completes, every
   trained group was on-policy (staleness 0), and no leased prompt was lost or trained twice.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest

from deploy import rundir
from tests.e2e.accounting import check_exactly_once, check_steps, read_run
from tests.support import Processes, wait_for

RUN_TIMEOUT_S = 300


def start_run(procs: Processes, run_dir: Path, model_dir: Path, *args: str):
    argv = [sys.executable, "-m", "deploy.cli", "run", "--model", str(model_dir), "--run-dir", str(run_dir),
            "--set", "eval.num_prompts=40", "--set", "eval.every_s=0", "--set", "launch.progress_every_s=1",
            "--set", "learner.checkpoint_every=5", "--set", "learner.save_adapter_every=4",
            "--set", "broker.heartbeat_interval_s=0.2", *args]
    return procs.spawn("launcher", argv)


def finish(procs: Processes, launcher) -> str:
    wait_for(lambda: not launcher.alive(), RUN_TIMEOUT_S, "loraflow run to finish", procs)
    out = launcher.log()
    assert launcher.popen.returncode == 0, out + procs.logs()
    return out


def test_short_demo(procs: Processes, tmp_path: Path, quick_base_dir: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_run(procs, run_dir, quick_base_dir, "--num-steps", "12", "--max-staleness", "1")
    out = finish(procs, launcher)
    base = float(re.search(r"^base accuracy: ([\d.]+)%$", out, re.M).group(1))
    final = float(re.search(r"^final accuracy: ([\d.]+)%$", out, re.M).group(1))
    assert 0 <= base <= 100 and 0 <= final <= 100
    assert "step " in out and "learner busy" in out  # the progress line was shown

    record = read_run(run_dir)
    check_steps(record, max_staleness=1, num_steps=12)
    check_exactly_once(record)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "run.num_steps (12) reached" and summary["steps"] == 12
    assert summary["final_version"] >= 12 and summary["base_accuracy"] == base / 100
    assert {"learner", "worker-1", "worker-2"} <= set(rundir.timelines(run_dir))
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"launcher.log", "broker.log", "learner.log",
                                                               "worker-1.log", "worker-2.log"}
    assert (run_dir / "config.toml").is_file()
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["learning.png", "staleness.png", "timeline.png"]

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(quick_base_dir)),
                                      str(run_dir / "final_adapter"))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(torch.count_nonzero(p) for p in lora_b)  # trained, not the zero initialisation


@pytest.mark.slow
def test_synchronous_run_survives_a_killed_worker(procs: Processes, tmp_path: Path, quick_base_dir: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_run(procs, run_dir, quick_base_dir, "--num-steps", "16", "--max-staleness", "0",
                         "--set", "launch.restart_backoff_s=0.5")

    def worker_pid_mid_run() -> int | None:
        steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
        starts = [e for e in rundir.read_jsonl(rundir.processes_path(run_dir))
                  if e["process"] == "worker-1" and e["event"] == "start"]
        return starts[-1]["pid"] if len(steps) >= 4 and starts else None

    pid = wait_for(worker_pid_mid_run, RUN_TIMEOUT_S, "the run to reach step 4", procs)
    import os

    os.kill(pid, signal.SIGKILL)
    out = finish(procs, launcher)
    assert "worker-1 stopped unexpectedly (signal SIGKILL); restarting" in out
    events = [(e["process"], e["event"]) for e in rundir.read_jsonl(rundir.processes_path(run_dir))]
    assert events.count(("worker-1", "start")) == 2
    assert json.loads((run_dir / "summary.json").read_text())["restarts"] == {"worker-1": 1}

    record = read_run(run_dir)
    check_steps(record, max_staleness=0, num_steps=16)  # synchronous: every trained group was on-policy
    check_exactly_once(record)
