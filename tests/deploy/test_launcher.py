"""`loraflow run` pieces that need no training: run directories and clear errors (GPU assignment: test_devices.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraflow.common.config import load_config
from loraflow.deploy import rundir
from loraflow.deploy.launcher import DEMO_CONFIG, choose_run_dir
from loraflow.deploy.results import version_step
from tests.support import child_env


def test_a_fresh_run_dir_unless_one_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fresh = choose_run_dir(load_config(DEMO_CONFIG))
    assert fresh.run_dir.parent == Path("runs") and fresh.run_dir.name.startswith("demo-")
    fresh.run_dir.mkdir(parents=True)
    assert choose_run_dir(load_config(DEMO_CONFIG)).run_dir != fresh.run_dir  # never reuses an existing one
    named = load_config(DEMO_CONFIG, ["run.run_dir=\"runs/exp1\""])
    assert choose_run_dir(named).run_dir == Path("runs/exp1")  # a named one is resumed


def test_version_step_reads_the_learner_metrics(tmp_path: Path) -> None:
    rundir.append_jsonl(rundir.metrics_path(tmp_path), {"step": 3, "version": 4})
    assert version_step(tmp_path, 4) == 3 and version_step(tmp_path, 0) == 0 and version_step(tmp_path, 9) == 0


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "run", "--run-dir", str(tmp_path / "run"), *args],
                          env=child_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    result = run(tmp_path, "--model", str(tmp_path / "absent"))
    assert result.returncode == 2  # a config error, found before anything starts (deploy/preflight.py)
    assert f"config error: model.path = '{tmp_path / 'absent'}' does not exist" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_config_value_names_the_key(tmp_path: Path) -> None:
    result = run(tmp_path, "--set", "launch.num_workers=-1")
    assert result.returncode == 2 and "launch.num_workers: must be >= 0, got -1" in result.stderr


def test_a_learner_that_cannot_start_ends_the_run_with_its_log(tmp_path: Path, tiny_model_dir: Path) -> None:
    # the learner exits 2 (a config error found at start-up): fatal at once, whatever launch.max_restarts says
    result = run(tmp_path, "--model", str(tiny_model_dir), "--workers", "1", "--set", "launch.max_restarts=3",
                 "--set", "learner.target_modules=[\"no_such_module\"]", "--set", "eval.num_prompts=0")
    assert result.returncode == 2, result.stdout + result.stderr  # the learner's config error is the run's
    assert "learner refused to start (exit code 2: a usage or config error)" in result.stdout
    assert "no_such_module" in result.stdout  # the tail of its log says why
    events = rundir.read_jsonl(rundir.processes_path(tmp_path / "run"))
    started = {e["process"] for e in events if e["event"] == "start"}
    exited = {e["process"] for e in events if e["event"] == "exit"}
    assert started == exited == {"broker", "learner", "worker-1"}  # nothing left running
    assert not any(p.is_file() for p in [tmp_path / "run" / "final_adapter" / "adapter_config.json"])
    assert os.path.isfile(tmp_path / "run" / "summary.json")


@pytest.mark.parametrize("missing", ["learner.key_secret", "observer.key_secret", "broker.key_secret"])
def test_a_missing_key_file_stops_the_run_at_once(tmp_path: Path, tiny_model_dir: Path, missing: str) -> None:
    """Every role of `loraflow run` runs here, so every role's key files are checked before anything starts: the
    learner's, the workers', the broker's and the observer pair of the progress line."""
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "keys", str(keys)], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    (keys / missing).unlink()
    began = time.monotonic()
    result = run(tmp_path, "--model", str(tiny_model_dir), "--set", "security.enabled=true",
                 "--set", f"security.keys_dir={json.dumps(str(keys))}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert time.monotonic() - began < 60  # at once: no process started, no connect wait
    (line,) = result.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("loraflow run: ") and str(keys / missing) in line and "loraflow keys" in line
    assert not (tmp_path / "run").exists()
    # loraflow config does not know which roles this machine runs (a client's holds no broker secret): no key checks
    described = subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "config", "--model", str(tiny_model_dir), "--set",
                                "security.enabled=true", "--set", f"security.keys_dir={json.dumps(str(keys))}"],
                               env=child_env(), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert described.returncode == 0 and "enabled = true" in described.stdout, described.stderr


def test_a_worker_that_stops_mid_run_with_exit_2_is_not_said_to_have_refused_to_start(tmp_path: Path,
                                                                                       tiny_model_dir: Path) -> None:
    """A reward that fails on every sample stops its worker with exit code 2 after it had been generating: the run
    ends with exit code 2 (nothing restarted) and a message that says so, with the worker's last line."""
    result = run(tmp_path, "--model", str(tiny_model_dir), "--workers", "1", "--set", 'worker.backend="sim"',
                 "--set", "integrity.check=false",
                 "--set", 'worker.reward="tests.worker.test_reward_failures:always_raises"',
                 "--set", "worker.max_failed_reward_groups=2", "--set", "eval.num_prompts=0",
                 "--set", "launch.max_restarts=3")
    assert result.returncode == 2, result.stdout + result.stderr
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: worker-1 stopped with a config-class error (exit code 2, after "), error
    assert "reward_failing" in error and "RuntimeError: reward service unavailable" in error  # its last line
    events = rundir.read_jsonl(rundir.processes_path(tmp_path / "run"))
    assert [e["code"] for e in events if e["process"] == "worker-1" and e["event"] == "exit"] == [2]  # once


@pytest.mark.parametrize("keys_args, client_key, removed, said", [
    (["--worker", "gpu-1", "--learner", "trainer"], "gpu-1", None,  # one key for every client of the run
     "security.client_key = 'gpu-1': under `loraflow run` every client process uses that key, but the broker would "
     "refuse the learner's (it is authorised as a worker)"),
    ([], "", "authorized/worker/worker.key",  # the pair is there, its authorisation was removed
     "the worker key pair 'worker' in security.keys_dir = "),
])
def test_a_key_the_broker_would_refuse_stops_the_run_at_once(tmp_path: Path, tiny_model_dir: Path, keys_args: list[str],
                                                             client_key: str, removed: str | None, said: str) -> None:
    """Under `loraflow run` the broker's keys dir is the clients' too: a key not authorised for the role that uses it
    (the broker would answer its hello with `forbidden`, and the learner would be restarted into it) is a config
    error before anything starts."""
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "keys", str(keys), *keys_args], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    if removed:
        (keys / removed).unlink()
    sets = ["--set", "security.enabled=true", "--set", f"security.keys_dir={json.dumps(str(keys))}"]
    if client_key:
        sets += ["--set", f"security.client_key={json.dumps(client_key)}"]
    result = run(tmp_path, "--model", str(tiny_model_dir), *sets)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"loraflow run: config error: {said}"), line
    assert not (tmp_path / "run").exists()
