"""A stop signal while the learner starts (model loading, connecting) ends it at once with exit code 0: the
signal came before the loop could finish a step on it, and nothing was trained or published yet (a Slurm
``scancel`` or ``systemctl stop`` right after a start must not read as a failure)."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.support import Processes, wait_for


def test_sigterm_while_connecting_exits_0(procs: Processes, tmp_path: Path, tiny_model_dir: Path) -> None:
    learner = procs.python("learner", "loraflow.learner", "--endpoint", "tcp://127.0.0.1:9", "--run-dir", str(tmp_path / "run"),
                           "--set", f'model.path="{tiny_model_dir}"', "--set", "run.connect_timeout_s=120")
    resolved = tmp_path / "run" / "learner" / "config.toml"  # written before the model is built
    wait_for(lambda: resolved.is_file() or not learner.alive(), 120, "the learner to start up", procs)
    assert learner.alive(), learner.log()
    learner.signal(signal.SIGTERM)
    wait_for(lambda: not learner.alive(), 30, "the learner to stop", procs)
    assert learner.popen.returncode == 0, learner.log()[-3000:]
    assert "stopped_during_startup" in learner.log(), learner.log()[-3000:]
