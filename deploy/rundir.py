"""The files of a run directory that the launcher writes and the progress display and plots read.

    <run_dir>/config.toml              the resolved config (written by the launcher)
    <run_dir>/evals.jsonl              held-out accuracy measurements (the launcher): base, periodic, final
    <run_dir>/processes.jsonl          every child's starts and exits (the launcher)
    <run_dir>/summary.json             the launcher's final figures (accuracies, steps, wall time, stop reason)
    <run_dir>/logs/<process>.log       each process's output
    <run_dir>/learner/metrics.jsonl    one line per learner step (learner/metrics_log.py)
    <run_dir>/learner/adapters/vNNNNNN PEFT directories (learner/publish.py)
    <run_dir>/timeline/<process>.jsonl state changes, alive and final marks (common/timeline.py)
    <run_dir>/plots/*.png              deploy/plots.py

JSONL files are appended to by running processes, so a reader may meet a torn last line: it is skipped.
Two readers turn raw lines into what happened: :func:`timelines` (each process's lives: where its lane ends,
its restarts, its busy share over the time it was alive) and :func:`learner_history` (the committed steps, and
the ones a learner restart withdrew). Files that exist only under ``loraflow run`` (processes.jsonl,
evals.jsonl, summary.json) make them more exact but are never required.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow.common.timeline import ALIVE_EVERY_S, Life, read_lives

#: states during which a process does useful work (the rest is waiting, idle, starting, stopping)
BUSY_STATES = frozenset({"generating", "scoring", "training", "publishing"})

_ADAPTER_DIR = re.compile(r"^v(\d+)$")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The objects of a JSONL file (empty if it does not exist), skipping lines that do not parse."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


def append_jsonl(path: str | os.PathLike, item: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(item) + "\n")


def metrics_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "learner" / "metrics.jsonl"


def summary_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "summary.json"


def evals_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "evals.jsonl"


def processes_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "processes.jsonl"


def adapters_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "learner" / "adapters"


def newest_adapter(run_dir: str | os.PathLike) -> tuple[int, Path | None]:
    """(version, directory) of the newest complete PEFT adapter the learner wrote; (0, None) if none."""
    root = adapters_root(run_dir)
    best: tuple[int, Path | None] = (0, None)
    if root.is_dir():
        for path in root.iterdir():
            match = _ADAPTER_DIR.match(path.name)
            if match and (path / "adapter_config.json").is_file() and int(match.group(1)) > best[0]:
                best = (int(match.group(1)), path)
    return best


# -- timelines: one lane per process ---------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Lane:
    """One process's lives as its timeline file and the launcher's exit records tell them.

    A life's ``ended`` says how it ended: ``stopped`` (a clean stop), ``exited`` (an exit without one, or an exit
    record with a code), ``killed`` (an exit record with a signal), ``running`` (its last line is recent: it is
    still there), ``lost`` (no final mark, no exit record: killed by SIGKILL or the OOM killer, or the machine went).
    """

    name: str
    lives: list[Life]

    def spans(self) -> list[tuple[float, float, str]]:
        return [span for life in self.lives for span in life.spans()]

    def alive_s(self) -> float:
        return sum(life.end_s - life.start_s for life in self.lives)

    def _ready_spans(self) -> list[tuple[float, float, str]]:
        return [s for s in self.spans() if s[2] not in ("starting", "stopping")]

    def ready_s(self) -> float:
        """Time alive after start-up and before shut-down."""
        return sum(end - start for start, end, _ in self._ready_spans())

    def busy_share(self) -> float | None:
        """Fraction of the ready time (:meth:`ready_s`) spent in a busy state (None before it was ready): the
        time between a death and a restart counts for nothing."""
        spans = self._ready_spans()
        total = sum(end - start for start, end, _ in spans)
        if total <= 0:
            return None
        return sum(end - start for start, end, state in spans if state in BUSY_STATES) / total

    def restarts(self) -> list[float]:
        """Unix times at which a later life began."""
        return [life.start_s for life in self.lives[1:]]

    def outages(self) -> list[tuple[float, float]]:
        """(last sign of life, restart) between consecutive lives."""
        return [(a.end_s, b.start_s) for a, b in itertools.pairwise(self.lives)]


def timelines(run_dir: str | os.PathLike, now_s: float | None = None) -> dict[str, Lane]:
    """Process name -> its lane, learner first, then brokers and workers by name.

    Under ``loraflow run`` the launcher's records (``processes.jsonl``) make the lives exact: a life begins at its
    process's start record (the start-up before its first mark is shown as ``starting``) and, when it wrote no
    final mark, ends at its exit record. Without them a life is what its timeline says, and its last life counts
    as ``running`` while its last line is less than three alive periods older than ``now_s``."""
    now_s = time.time() if now_s is None else now_s
    directory = Path(run_dir) / "timeline"
    paths = sorted(directory.glob("*.jsonl")) if directory.is_dir() else []
    records = _launcher_records(run_dir)
    lanes = {}
    for path in paths:
        lives = read_lives(path)
        if lives:
            _apply_records(lives, records.get((path.stem, "start"), []), records.get((path.stem, "exit"), []),
                           now_s)
            lanes[path.stem] = Lane(name=path.stem, lives=lives)
    order = sorted(lanes, key=lambda name: (name != "learner", name != "broker", name))
    return {name: lanes[name] for name in order}


def _apply_records(lives: list[Life], starts: list[tuple[float, int | None]], exits: list[tuple[float, int | None]],
                   now_s: float) -> None:
    for i, life in enumerate(lives):
        after = lives[i - 1].end_s if i else float("-inf")
        started = [t for t, _ in starts if after < t < life.start_s]
        if started:  # the newest start before its first mark (an earlier one may have crashed before marking)
            first_t, first_state = life.transitions[0]
            life.transitions[0:1] = ([(started[-1], first_state)] if first_state == "starting"
                                     else [(started[-1], "starting"), (first_t, first_state)])
            life.start_s = started[-1]
        if life.ended:
            continue
        until = lives[i + 1].start_s if i + 1 < len(lives) else float("inf")
        record = next(((t, code) for t, code in exits if life.start_s <= t < until), None)
        if record is not None:
            life.end_s = max(life.end_s, record[0])
            life.ended = "killed" if record[1] is not None and record[1] < 0 else "exited"
        elif i + 1 == len(lives) and now_s - life.end_s < 3 * ALIVE_EVERY_S:
            life.ended = "running"
        else:
            life.ended = "lost"


def _launcher_records(run_dir: str | os.PathLike) -> dict[tuple[str, str], list[tuple[float, int | None]]]:
    """(process name, "start" | "exit") -> (unix time, exit code or None) of each record, in order."""
    out: dict[tuple[str, str], list[tuple[float, int | None]]] = {}
    for item in read_jsonl(processes_path(run_dir)):
        event, code = item.get("event"), item.get("code")
        if event in ("start", "exit") and isinstance(item.get("t"), int | float):
            out.setdefault((str(item.get("process")), event), []).append(
                (float(item["t"]), code if isinstance(code, int) else None))
    return out


# -- the learner's step history ----------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Resume:
    """A learner session that resumed from the checkpoint of ``step`` (the steps after it were withdrawn)."""

    session: str
    step: int
    time_unix: float | None  # of its first step line


@dataclass(slots=True, kw_only=True)
class LearnerHistory:
    """metrics.jsonl read as history: ``committed`` is the chain of steps the newest session descends from (each
    step once, in order), ``withdrawn`` the lines of steps a later session rolled back, in file order."""

    committed: list[dict[str, Any]] = field(default_factory=list)
    withdrawn: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[Resume] = field(default_factory=list)


def learner_history(lines: list[dict[str, Any]]) -> LearnerHistory:
    """Cut the step lines back at every resume: a line of a new ``session`` says the step it resumed from
    (``resumed_step``, see :mod:`loraflow.learner.metrics_log`); every earlier line with a higher step is withdrawn.
    Files from before sessions were written are cut where the step number goes back."""
    history = LearnerHistory()
    session: str | None = None
    for line in lines:
        if not isinstance(line.get("step"), int):
            continue
        step, this = line["step"], str(line.get("session", ""))
        cut = None
        if session is not None and this != session:
            cut = int(line.get("resumed_step", step - 1))
        elif history.committed and step <= history.committed[-1]["step"]:
            cut = step - 1
        if cut is not None:
            history.resumes.append(Resume(session=this, step=cut, time_unix=line.get("time_unix")))
            keep = len(history.committed)
            while keep and history.committed[keep - 1]["step"] > cut:
                keep -= 1
            history.withdrawn += history.committed[keep:]
            del history.committed[keep:]
        history.committed.append(line)
        session = this
    return history


def read_learner_history(run_dir: str | os.PathLike) -> LearnerHistory:
    return learner_history(read_jsonl(metrics_path(run_dir)))
