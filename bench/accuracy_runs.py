"""Sync vs async time-to-accuracy runs, shared by bench/time_to_accuracy.py and bench/agent_demo.py.

Both benches run ``loraflow run`` twice on one config, once at ``max_staleness 0`` and once at the config's own
setting, then evaluate the PEFT adapters each run saved, in version order, and time the first that reaches the
target from the start of the run's first process (:func:`time_to_target`). What differs is the config, the
command line, and how an adapter is evaluated; :func:`compare` is the loop around them and prints one line per
run.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow.common.config import Config, load_config
from loraflow.deploy import rundir
from tests.support import child_env  # noqa: F401 - the benches' child environment, as before

REPO = Path(__file__).resolve().parent.parent

Evaluate = Callable[[Config, int, Path], float]  # (the run's config, version, adapter dir) -> held-out accuracy


@dataclass(slots=True, kw_only=True)
class Outcome:
    max_staleness: int
    seconds_to_target: float | None
    version_at_target: int | None
    accuracies: dict[int, float] = field(default_factory=dict)  # version -> accuracy, the adapters evaluated
    steps: int
    seconds_per_step: float

    @property
    def best_accuracy(self) -> float:
        return max(self.accuracies.values(), default=0.0)


def run_loraflow(argv: Sequence[str], *, max_staleness: int, env: dict[str, str], timeout_s: float,
                 show: tuple[str, ...] = ("stopping:",)) -> None:
    """``python -m loraflow.deploy.cli run`` + ``argv``; prints the output lines that start with ``show``."""
    result = subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "run", *argv], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"loraflow run (max_staleness {max_staleness}) failed:\n{result.stdout}\n{result.stderr}")
    lines = [line for line in result.stdout.splitlines() if line.startswith(show)]
    print(f"max_staleness {max_staleness}: " + "; ".join(lines), flush=True)


def step_s(steps: list[dict]) -> float:
    if len(steps) < 2:
        return float("nan")
    return (steps[-1]["time_unix"] - steps[0]["time_unix"]) / (len(steps) - 1)


def time_to_target(run_dir: Path, max_staleness: int, target: float, evaluate: Evaluate,
                   on_accuracy: Callable[[int, float], None] | None = None) -> Outcome:
    """Evaluate the saved adapters in order; the first to reach the target, timed from the first process start."""
    config = load_config(run_dir / "config.toml")
    starts = [e["t"] for e in rundir.read_jsonl(rundir.processes_path(run_dir)) if e["event"] == "start"]
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    made_at = {s["version"]: s["time_unix"] for s in steps}
    adapters = sorted((int(p.name[1:]), p) for p in rundir.adapters_root(run_dir).glob("v*")
                      if (p / "adapter_config.json").is_file())
    outcome = Outcome(max_staleness=max_staleness, seconds_to_target=None, version_at_target=None,
                      steps=len(steps), seconds_per_step=step_s(steps))
    for version, path in adapters:
        accuracy = outcome.accuracies[version] = evaluate(config, version, path)
        if on_accuracy is not None:
            on_accuracy(version, accuracy)
        if accuracy >= target and version in made_at:
            outcome.seconds_to_target = made_at[version] - min(starts)
            outcome.version_at_target = version
            break
    return outcome


def compare(stalenesses: Sequence[int], *, prefix: str, run: Callable[[Path, int], Any], target: float,
            max_duration_s: float, evaluate: Evaluate, show_each: bool = False) -> tuple[Outcome, Outcome]:
    """One run per staleness (``run(run_dir, max_staleness)``) in a temporary directory, each timed to the target;
    prints a line per run (and per adapter evaluated with ``show_each``). Returns (sync, async); a run that
    misses the target ends the bench."""
    outcomes = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for max_staleness in stalenesses:
            run_dir = Path(tmp) / f"staleness-{max_staleness}"
            run(run_dir, max_staleness)

            def show(version: int, accuracy: float, m: int = max_staleness) -> None:
                print(f"  max_staleness {m} v{version}: {accuracy:.1%}", flush=True)

            o = time_to_target(run_dir, max_staleness, target, evaluate, show if show_each else None)
            outcomes.append(o)
            reached = (f"{o.seconds_to_target:.1f} s (v{o.version_at_target})" if o.seconds_to_target is not None
                       else f"not reached in {max_duration_s:.0f} s (best {o.best_accuracy:.1%})")
            print(f"max_staleness {max_staleness}: target {target:.0%} {reached}; {o.steps} steps, "
                  f"{o.seconds_per_step:.2f} s/step", flush=True)
    sync, async_ = outcomes
    if sync.seconds_to_target is None or async_.seconds_to_target is None:
        raise SystemExit("a run did not reach the target; raise --max-duration or lower --target")
    return sync, async_
