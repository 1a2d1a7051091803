"""`loraflow run` end to end: the launcher starts a broker, two hf workers and a learner as real processes.

1. A shortened demo: versions advance, every trained group was within max_staleness, rewards are finite, the
   final adapter loads with peft, the run directory holds what the README promises.
2. Synchronous mode, one epoch, a worker and then the learner killed (SIGKILL) mid-run: the launcher restarts
   both (the learner resumes from its checkpoint), the run completes by itself, every trained group was
   on-policy (staleness 0), and no leased prompt was lost or trained twice.
3. Ctrl-C of a run with CURVE on (its progress line fed by the broker over CURVE): every process exits cleanly
   and the newest adapter is kept.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.deploy import rundir
from tests.e2e.accounting import check_exactly_once, check_steps, read_run
from tests.fault.ledger import audit_run
from tests.support import Processes, child_env, wait_for

RUN_TIMEOUT_S = 300


def start_run(procs: Processes, run_dir: Path, model_dir: Path, *args: str):
    argv = [sys.executable, "-m", "loraflow.deploy.cli", "run", "--model", str(model_dir), "--run-dir", str(run_dir),
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


def test_a_secured_run_stops_every_process_cleanly_on_ctrl_c_and_keeps_the_newest_adapter(
        procs: Processes, tmp_path: Path, quick_base_dir: Path) -> None:
    """With security.enabled every child connects with its role's CURVE key (made by `loraflow keys`); SIGINT to
    the launcher mid-run stops every process with SIGTERM (clean exits) and the newest adapter is kept."""
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "keys", str(keys)], check=True, capture_output=True,
                   env=child_env())
    run_dir = tmp_path / "run"
    launcher = start_run(procs, run_dir, quick_base_dir, "--num-steps", "0",
                         "--set", "security.enabled=true", "--set", f"security.keys_dir=\"{keys}\"")
    wait_for(lambda: len(rundir.read_jsonl(rundir.metrics_path(run_dir))) >= 3, RUN_TIMEOUT_S, "three steps", procs)
    wait_for(lambda: "workers 2" in launcher.log(), 30, "the progress line", procs)  # broker stats over CURVE
    launcher.signal(signal.SIGINT)
    wait_for(lambda: not launcher.alive(), 120, "the launcher to stop", procs)
    assert launcher.popen.returncode == 130, launcher.log()
    out = launcher.log()
    assert "SIGINT: stopping every process cleanly" in out and "final accuracy: " in out
    exits = {e["process"]: e["code"] for e in rundir.read_jsonl(rundir.processes_path(run_dir)) if e["event"] == "exit"}
    assert exits == {"broker": 0, "learner": 0, "worker-1": 0, "worker-2": 0}  # SIGTERM, clean exits, no kills
    steps = [s["step"] for s in rundir.read_jsonl(rundir.metrics_path(run_dir))]
    assert steps == list(range(1, len(steps) + 1)), steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted"
    newest_version, _ = rundir.newest_adapter(run_dir)
    published = max(s["version"] for s in rundir.read_jsonl(rundir.metrics_path(run_dir)))
    assert summary["final_version"] == newest_version >= published  # the learner wrote its newest version
    assert (run_dir / "final_adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_synchronous_run_survives_a_killed_worker_and_learner(procs: Processes, tmp_path: Path,
                                                              quick_base_dir: Path) -> None:
    """One epoch of 48 prompts, max_staleness 0; SIGKILL worker-1, later the learner (after its checkpoint at
    step 5): the launcher restarts both, the run completes by itself, and the audit of tests/fault holds
    (every prompt trained exactly once in the committed history, nothing from a withdrawn version)."""
    run_dir = tmp_path / "run"
    launcher = start_run(procs, run_dir, quick_base_dir, "--num-steps", "12", "--max-staleness", "0",
                         "--log-format", "json", "--set", "run.groups_per_step=4", "--set", "broker.prompt_limit=48",
                         "--set", "broker.num_epochs=1", "--set", "launch.restart_backoff_s=0.5")

    def pid_once(process: str, min_step: int, ready=lambda: True):
        def probe() -> int | None:
            steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
            starts = [e for e in rundir.read_jsonl(rundir.processes_path(run_dir))
                      if e["process"] == process and e["event"] == "start"]
            return starts[-1]["pid"] if steps and steps[-1]["step"] >= min_step and starts and ready() else None
        return wait_for(probe, RUN_TIMEOUT_S, f"step {min_step} before killing {process}", procs)

    os.kill(pid_once("worker-1", 3), signal.SIGKILL)
    checkpoint = run_dir / "learner" / "checkpoints" / "step_00000005" / "learner_state.json"
    os.kill(pid_once("learner", 7, checkpoint.is_file), signal.SIGKILL)
    out = finish(procs, launcher)
    assert "worker-1 stopped unexpectedly (signal SIGKILL); restarting" in out
    assert "learner stopped unexpectedly (signal SIGKILL); restarting" in out
    assert json.loads((run_dir / "summary.json").read_text())["restarts"] == {"worker-1": 1, "learner": 1}

    audit = audit_run(run_dir, [run_dir / "logs" / "worker-1.log", run_dir / "logs" / "worker-2.log"], 48)
    assert len(audit.starts) == 2 and audit.steps_lost >= 2, audit.summary()
    assert len(audit.chain) == 12
    for step in audit.chain:  # synchronous: every trained token came from the version being trained
        for group_id, token_versions in step["versions"].items():
            assert set(token_versions) == {step["trained_version"]}, (step["step"], group_id, token_versions)
