"""Experiment tracking: ``run.report_to`` sends a run's config, step metrics and held-out evaluations to
Weights & Biases and/or TensorBoard (TRL's names, ``["wandb", "tensorboard"]``; the default ``[]`` is none).

Who writes what:

- The learner's rank 0 owns a run's trackers (:func:`open_tracker`; the other ranks, and a run that reports to
  nothing, get :class:`NullTracker`). It logs the resolved config once, then every step's metrics: the dict
  ``metrics.jsonl`` gets (it is a :class:`loraflow.learner.metrics_log.MetricsLog` sink), its numbers under ``train/``
  (nested tables flattened, ``train/staleness/0``) at the learner step; strings are left out.
- Held-out evaluations are measured by the launcher (deploy/), not by the learner, and appended to
  ``<run_dir>/evals.jsonl``. The tracker *tails* that file: after each step and when it closes, it logs the lines
  it has not logged yet under ``eval/`` (``eval/accuracy``, ``eval/version``...) at the step of the adapter
  measured. The file, not the launcher, feeds the trackers because a W&B run has one writer at a time (two
  processes logging into one run id conflict online and split into separate runs offline), and the learner is
  the process that holds the run while it trains; evals.jsonl is already the durable hand-off between the two.
  The launcher's final measurement is taken after the learner stopped, so the launcher calls
  :func:`log_new_evals` once it has written it: the trackers reopen (same W&B run id) and log what is new.
- ``<run_dir>/tracking.json`` holds the W&B run id and how many evals.jsonl lines were logged, so a restarted
  learner continues the same W&B run and no evaluation is logged twice.

Where it goes: TensorBoard event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>``); W&B in
project ``$WANDB_PROJECT`` (default ``loraflow``), named ``run.name``, files under ``<run_dir>/wandb``.
``WANDB_MODE=offline`` keeps everything on disk: each process that wrote has its own
``offline-run-*`` directory with the same run id, and ``wandb sync <run_dir>/wandb/offline-run-*`` uploads them
into one run. Console capture is off (the processes' logs are in ``<run_dir>/logs``).

Both packages are optional (``pip install 'loraflow[tracking]'``); :func:`check_available` makes a missing one a
config error at start-up, before the model loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loraflow.common.config import Config, to_toml
from loraflow.common.logging import get_logger
from loraflow.common.schema import dump

log = get_logger("tracking")

#: run.report_to name -> the module it needs
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}
INSTALL_HINT = "pip install 'loraflow[tracking]'"
STATE_FILE = "tracking.json"


class TrackingUnavailable(ValueError):
    """``run.report_to`` names a tracker whose package is not installed (a config error: exit 2)."""


def check_available(report_to: Sequence[str]) -> None:
    """Raise :class:`TrackingUnavailable` if a named tracker's package is missing (nothing is imported)."""
    missing = [name for name in report_to if importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:
        raise TrackingUnavailable(f"run.report_to = {list(report_to)} needs {' and '.join(missing)}, not "
                                  f"installed here: {INSTALL_HINT} (or drop them from run.report_to)")


def scalars(record: dict[str, Any], prefix: str) -> dict[str, float]:
    """The numbers of a metrics/eval record, nested tables flattened: ``{"a": {"b": 1}}`` -> ``prefix/a/b``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name))
        elif isinstance(value, int | float):  # bool too, as 0/1
            out[name] = float(value)
    return out


# -- backends: each writes scalars at a step; the Tracker decides what and when ---------------------------------

class TensorBoardBackend:
    """Event files under ``<run_dir>/tensorboard`` (a new file per process; TensorBoard reads them together)."""

    def __init__(self, logdir: Path, config_text: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))
        if config_text is not None:  # indented: the text plugin renders it as a code block
            self.writer.add_text("config", "\n".join(f"    {line}" for line in config_text.splitlines()), 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a killed learner keeps every step it reported

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """One W&B run per loraflow run (the id in tracking.json); ``train/*`` and ``eval/*`` each on their own step."""

    def __init__(self, run_dir: Path, *, name: str, run_id: str, config: dict[str, Any] | None) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "loraflow"), name=name, id=run_id,
                              resume="allow", dir=str(run_dir), config=config,
                              settings=wandb.Settings(console="off"))
        for axis in ("train", "eval"):  # an eval at an earlier step than the last train step is still kept
            self.run.define_metric(f"{axis}/step")
            self.run.define_metric(f"{axis}/*", step_metric=f"{axis}/step")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values)  # holds {axis}/step: the record's own step

    def close(self) -> None:
        self.run.finish()


# -- the tracker ------------------------------------------------------------------------------------------------

class NullTracker:
    """What ranks other than 0, and runs that report to nothing, hold."""

    def log_step(self, metrics: dict[str, Any]) -> None:
        pass

    def log_new_evals(self) -> int:
        return 0

    def close(self) -> None:
        pass


class Tracker:
    """The run's trackers: step metrics as they come, evaluations as they appear in evals.jsonl."""

    def __init__(self, run_dir: Path, backends: Sequence[Any], state: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.backends = list(backends)
        self.state = state

    def log_step(self, metrics: dict[str, Any]) -> None:
        values = scalars(metrics, "train")
        for backend in self.backends:
            backend.log(values, int(metrics["step"]))
        self.log_new_evals()

    def log_new_evals(self) -> int:
        """Log the evals.jsonl lines not logged yet (a torn last line waits for its end); returns how many."""
        lines = _complete_lines(self.run_dir / "evals.jsonl")[self.state["evals_logged"]:]
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("eval_line_unreadable", line=line[:200])
                continue
            values = scalars(record, "eval")
            values["eval/step"] = float(record.get("step", 0))
            for backend in self.backends:
                backend.log(values, int(values["eval/step"]))
        if lines:
            self.state["evals_logged"] += len(lines)
            _write_state(self.run_dir, self.state)
        return len(lines)

    def close(self) -> None:
        self.log_new_evals()
        for backend in self.backends:
            backend.close()


def open_tracker(config: Config, *, is_main: bool = True, log_config: bool = True) -> Tracker | NullTracker:
    """The trackers ``run.report_to`` names for this process (raises TrackingUnavailable if one is missing)."""
    report_to = list(config.run.report_to)
    if not report_to or not is_main:
        return NullTracker()
    check_available(report_to)
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    state = _read_state(run_dir)
    backends: list[Any] = []
    if "tensorboard" in report_to:
        backends.append(TensorBoardBackend(run_dir / "tensorboard", to_toml(config) if log_config else None))
    if "wandb" in report_to:
        backends.append(WandbBackend(run_dir, name=config.run.name, run_id=state["wandb_run_id"],
                                     config=dump(config) if log_config else None))
    log.info("tracking", report_to=report_to, run_dir=str(run_dir), wandb_run_id=state["wandb_run_id"])
    return Tracker(run_dir, backends, state)


def log_new_evals(config: Config) -> int:
    """For the launcher, after the learner stopped: log the evaluations it did not see; returns how many."""
    if not config.run.report_to:
        return 0
    tracker = open_tracker(config, log_config=False)
    try:
        return tracker.log_new_evals()
    finally:
        tracker.close()


def _complete_lines(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [line for line in text.split("\n")[:-1] if line.strip()]  # the part after the last newline is torn


def _read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE_FILE
    state: dict[str, Any] = {}
    if path.is_file():
        state = json.loads(path.read_text())
    if not state.get("wandb_run_id"):
        state["wandb_run_id"] = secrets.token_hex(8)
    state.setdefault("evals_logged", 0)
    _write_state(run_dir, state)
    return state


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / f"{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state) + "\n")
    os.replace(tmp, run_dir / STATE_FILE)
