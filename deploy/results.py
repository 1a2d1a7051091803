"""What a ``loraflow run`` measures and reports: held-out accuracy, its measurements, the summary and result lines.

:func:`evaluate_run` is the one measurement the launcher takes (of the base, periodically of the newest adapter,
and of the final one): an in-process agent harness plays its episodes (:mod:`loraflow.deploy.agent_eval`), any
other config gets the greedy single-turn accuracy (:mod:`loraflow.deploy.evaluate`). Each becomes a
:class:`Measurement` (a line of ``<run_dir>/evals.jsonl``); the run ends with a :class:`Summary`
(``<run_dir>/summary.json``) and the lines :func:`print_result` prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from loraflow.common.config import Config
from loraflow.deploy import rundir

if TYPE_CHECKING:
    from loraflow.deploy.evaluate import EvalResult


def evaluate_run(config: Config, adapter_dir: str | os.PathLike | None = None, *, device: str = "auto") -> EvalResult:
    """What ``loraflow run`` measures for ``config``: an in-process agent harness (``worker.agent``) playing its
    episodes through a gateway (:mod:`loraflow.deploy.agent_eval`), else the greedy single-turn accuracy
    (:func:`loraflow.deploy.evaluate.evaluate_dir`)."""
    if config.worker.agent and config.worker.agent != "external":
        from loraflow.deploy.agent_eval import evaluate_agent

        return evaluate_agent(config, adapter_dir, num_prompts=config.eval.num_prompts, device=device)
    from loraflow.deploy.evaluate import evaluate_dir

    return evaluate_dir(config.model.path, adapter_dir, task=config.run.task, seed=config.run.seed,
                        num_prompts=config.eval.num_prompts, max_new_tokens=config.worker.max_new_tokens,
                        chat_template_kwargs=config.model.chat_template_kwargs, data=config.data, device=device)


@dataclass(slots=True, kw_only=True)
class Measurement:
    """One held-out accuracy of the run (a line of ``<run_dir>/evals.jsonl``)."""

    version: int
    step: int
    accuracy: float
    time_unix: float
    seconds: float
    kind: str  # base | periodic | final


@dataclass(slots=True, kw_only=True)
class Summary:
    """What a run ended with (also written to ``<run_dir>/summary.json``).

    ``wall_s`` is the whole ``loraflow run``; ``base_build_s`` the demo base build in it (0 when cached);
    ``rl_s`` and ``target_reached_s`` count from starting the processes (the clock of the progress line).
    ``steps`` is the last committed learner step (not one a restart withdrew); ``busy_share`` each process's
    busy share over the time it was alive (its timeline lane, :mod:`loraflow.deploy.rundir`).
    """

    run_dir: str
    seed: int
    stop_reason: str = ""
    error: str = ""
    base_accuracy: float | None = None
    final_accuracy: float | None = None
    final_version: int = 0
    final_adapter: str = ""
    steps: int = 0
    wall_s: float = 0.0
    base_build_s: float = 0.0
    rl_s: float = 0.0
    target_reached_s: float | None = None
    restarts: dict[str, int] = field(default_factory=dict)
    busy_share: dict[str, float] = field(default_factory=dict)  # process -> busy share of its time alive


def version_step(run_dir: Path, version: int) -> int:
    """The learner step whose parameters adapter ``version`` holds (0 for the base)."""
    if version == 0:
        return 0
    for line in reversed(rundir.read_jsonl(rundir.metrics_path(run_dir))):
        if line.get("version") == version:
            return int(line.get("step", 0))
    return 0


def accuracy(measurement: Measurement | None) -> float | None:
    """The accuracy of a measurement; None when there is none (evaluation stopped for the run)."""
    return None if measurement is None else measurement.accuracy


def print_result(summary: Summary, out: TextIO) -> None:
    """The lines a run ends with: base and final accuracy, the gain, the final adapter and the run directory."""
    if summary.base_accuracy is not None:
        print(f"base accuracy: {summary.base_accuracy:.1%}", file=out)
    if summary.final_accuracy is not None:
        print(f"final accuracy: {summary.final_accuracy:.1%}", file=out)
    if summary.base_accuracy is not None and summary.final_accuracy is not None:
        gain = 100 * (summary.final_accuracy - summary.base_accuracy)
        build = f"base build {summary.base_build_s:.0f} s, " if summary.base_build_s else ""
        print(f"gain: {gain:+.1f} points in {summary.wall_s:.0f} s ({build}{summary.steps} learner steps in "
              f"{summary.rl_s:.0f} s)", file=out)
    if summary.final_adapter:
        print(f"final adapter (v{summary.final_version}, PEFT): {summary.final_adapter}", file=out)
    print(f"run directory: {summary.run_dir} (config.toml, logs/, learner/metrics.jsonl, evals.jsonl, plots/)",
          file=out)
