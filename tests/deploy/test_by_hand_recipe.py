"""deploy/README.md's by-hand recipe, run as written: its fenced bash blocks (each after a ``<!-- by-hand recipe:
NAME -->`` line) go through one bash process in order, and only two of the recipe's own variables differ
(``RUN_DIR`` in tmp, ``PORT`` a free one). Its ``MODEL=$(python -m loraflow.deploy.demo_base --seed 0 ...)`` line runs as
written against a cache (``LORAFLOW_CACHE``) in which a quickly warmed-up base stands where the demo base of seed 0
is kept. Between starting and stopping the test waits for a few learner steps. Then: every process exited 0 in the documented stop order, the learner trained steps,
every issued prompt was trained once or is still owed by the broker (tests/e2e/accounting.py), the plots exist.
A second run starts the same lines in reverse (workers, learner, then the broker once the learner waits for it):
the recipe's claim that any start order works within ``run.connect_timeout_s``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.common.config import load_config
from loraflow.common.timeline import STOPPED, read_lives
from loraflow.deploy import rundir
from loraflow.deploy.demo_base import demo_base_dir
from tests.e2e.accounting import check_exactly_once, read_run
from tests.e2e.conftest import quick_base_dir  # noqa: F401  (the session fixture: a base that earns rewards)
from tests.support import REPO, child_env

pytestmark = pytest.mark.slow

README = REPO / "deploy" / "README.md"
BLOCKS = ("setup", "start", "watch", "stop", "plot")
STEPS = 3  # learner steps to wait for before stopping
RUN_TIMEOUT_S = 200.0  # the whole script, then everything is killed; a run took 24-70 s on 2 busy cores
LEARNER_WAITING = ("run_token_wait", "broker_silent")  # the learner's log lines while it waits for the broker


def recipe_blocks(text: str) -> dict[str, list[str]]:
    """NAME -> the lines of the bash block that follows ``<!-- by-hand recipe: NAME -->``."""
    blocks = {}
    for name, body in re.findall(r"<!-- by-hand recipe: (\w+) -->\n```bash\n(.*?)```", text, flags=re.S):
        assert name not in blocks, f"two by-hand recipe blocks named {name}"
        blocks[name] = body.splitlines()
    assert set(blocks) == set(BLOCKS), f"deploy/README.md's by-hand recipe blocks: {sorted(blocks)}"
    return blocks


def with_values(lines: list[str], values: dict[str, str]) -> list[str]:
    """The lines with the recipe's own assignments of ``values``' names replaced (each must be there once)."""
    out, found = [], []
    for line in lines:
        match = re.match(r"(\w+)=", line)
        if match and match.group(1) in values:
            found.append(match.group(1))
            line = f"{match.group(1)}={values[match.group(1)]}"
        out.append(line)
    assert sorted(found) == sorted(values), f"the recipe assigns {found}, the test replaces {sorted(values)}"
    return out


def reversed_start(lines: list[str], run_dir: str) -> list[str]:
    """The start block's commands in reverse order, the broker (first as written) last: once the learner says it
    is waiting for it (for its run token, or for a Welcome), at most 90 s after it was started."""
    commands = [line for line in lines if line.startswith("loraflow ")]
    assert commands[0].startswith("loraflow broker ") and len(commands) == 4, commands
    learner_waits = (f"for i in $(seq 900); do grep -qE '{'|'.join(LEARNER_WAITING)}' {run_dir}/logs/learner.log "
                     "2>/dev/null && break; sleep 0.1; done")
    return [*reversed(commands[1:]), learner_waits, "date +broker_at=%s.%N", commands[0]]


def wait_for_steps(run_dir: str) -> str:
    """Bash: wait (at most 120 s) for STEPS lines in the learner's metrics.jsonl."""
    metrics = f"{run_dir}/learner/metrics.jsonl"
    return (f'for i in $(seq 1200); do [ "$(cat {metrics} 2>/dev/null | wc -l)" -ge {STEPS} ] && break; '
            "sleep 0.1; done; echo \"steps before stopping: $(cat " + metrics + " 2>/dev/null | wc -l)\"")


def demo_cache(cache: Path, model: Path) -> Path:
    """A model cache holding ``model`` where the demo base of seed 0 is kept (what its build would leave there)."""
    place = demo_base_dir(0, cache)
    place.parent.mkdir(parents=True)
    place.symlink_to(model, target_is_directory=True)
    return cache


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_recipe(tmp_path: Path, model: Path, *, reverse: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    blocks = recipe_blocks(README.read_text())
    run_dir = tmp_path / "by-hand"
    values = {"RUN_DIR": str(run_dir), "PORT": str(free_port())}
    start = reversed_start(blocks["start"], str(run_dir)) if reverse else blocks["start"]
    script = [*with_values(blocks["setup"], values), *start, wait_for_steps(str(run_dir)),
              *blocks["watch"], *blocks["stop"], *blocks["plot"]]
    env = child_env(LORAFLOW_CACHE=str(demo_cache(tmp_path / "cache", model)))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the venv active: loraflow, python
    bash = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = bash.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(bash.pid, signal.SIGKILL)  # bash and every process it started (no job control: one group)
        out, err = bash.communicate()
        pytest.fail(f"the recipe did not finish in {RUN_TIMEOUT_S:.0f} s:\n{out}\n{err}\n{logs(run_dir)}")
    finally:
        kill_session(bash.pid)
    return subprocess.CompletedProcess(bash.args, bash.returncode, out, err), run_dir


def kill_session(pgid: int) -> None:
    """Nothing the recipe started outlives the test."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def logs(run_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                     for p in sorted((run_dir / "logs").glob("*.log")))


def check_outcome(result: subprocess.CompletedProcess, run_dir: Path) -> None:
    shown = f"{result.stdout}\n{result.stderr}\n{logs(run_dir)}"
    assert result.returncode == 0, shown
    codes = re.findall(r"pid \d+ exited with code (\d+)", result.stdout)
    assert codes == ["0"] * 4, shown  # workers, learner, broker: each stopped cleanly on SIGTERM
    assert int(re.search(r"steps before stopping: (\d+)", result.stdout).group(1)) >= STEPS, shown
    config = load_config(run_dir / "config.toml")
    assert config.model.path == str(demo_base_dir(0, run_dir.parent / "cache"))  # MODEL: the path it printed
    assert "learner   learner" in result.stdout and "workers   2" in result.stdout, shown  # loraflow status
    history = rundir.read_learner_history(run_dir)
    steps = [line["step"] for line in history.committed]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= STEPS and not history.withdrawn
    check_exactly_once(read_run(run_dir))  # the learner's last checkpoint and the broker's state on stop agree
    for process in ("learner", "worker-1", "worker-2"):
        (life,) = read_lives(run_dir / "timeline" / f"{process}.jsonl")
        assert life.ended == STOPPED, f"{process}: {life}"
    assert rundir.newest_adapter(run_dir)[0] == steps[-1]  # the learner wrote its last adapter on stop
    assert {p.name for p in (run_dir / "plots").glob("*.png")} == {"learning.png", "staleness.png", "timeline.png"}
    assert not (run_dir / "evals.jsonl").exists() and not (run_dir / "processes.jsonl").exists()


def test_the_recipe_as_written(tmp_path: Path, quick_base_dir: Path) -> None:  # noqa: F811
    result, run_dir = run_recipe(tmp_path, quick_base_dir)
    check_outcome(result, run_dir)


def test_workers_and_learner_may_start_before_the_broker(tmp_path: Path, quick_base_dir: Path) -> None:  # noqa: F811
    result, run_dir = run_recipe(tmp_path, quick_base_dir, reverse=True)
    check_outcome(result, run_dir)
    broker_at = float(re.search(r"broker_at=([\d.]+)", result.stdout).group(1))
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert any(line in learner_log for line in LEARNER_WAITING), learner_log  # it waited, then joined and trained
    for process in ("worker-1", "worker-2"):  # up and waiting for the broker before it was started
        (life,) = read_lives(run_dir / "timeline" / f"{process}.jsonl")
        assert life.start_s < broker_at, f"{process} began {life.start_s - broker_at:.1f} s after the broker"


def test_a_learner_whose_broker_never_comes_waits_the_timeout_and_says_why(tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    """Past run.connect_timeout_s a learner started first gives up with one line (exit 1): with security off it
    was still waiting for the run token the broker writes into the run directory on its first start."""
    run_dir = tmp_path / "alone"
    learner = subprocess.run([sys.executable, "-m", "loraflow.learner", "--model", str(tiny_model_dir), "--run-dir",
                              str(run_dir), "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--set",
                              "run.connect_timeout_s=3"], env=child_env(), capture_output=True, text=True, timeout=120)
    assert learner.returncode == 1, learner.stderr
    errors = [line for line in learner.stderr.splitlines() if "[error" in line]
    assert len(errors) == 1 and "broker_unavailable" in errors[0], learner.stderr
    assert f"no run token at {run_dir / 'broker' / 'run_token'} within 3 s (run.connect_timeout_s)" in errors[0]
    assert "run_token_wait" in learner.stderr and "Traceback" not in learner.stderr
