"""The files of a run directory that the launcher writes and the progress display and plots read.

    <run_dir>/config.toml              the resolved config (written by the launcher)
    <run_dir>/evals.jsonl              held-out accuracy measurements (the launcher): base, periodic, final
    <run_dir>/processes.jsonl          every child's starts and exits (the launcher)
    <run_dir>/summary.json             the launcher's final figures (accuracies, steps, wall time, stop reason)
    <run_dir>/logs/<process>.log       each process's output
    <run_dir>/learner/metrics.jsonl    one line per learner step (learner/train.py)
    <run_dir>/learner/adapters/vNNNNNN PEFT directories (learner/publish.py)
    <run_dir>/timeline/<process>.jsonl busy/waiting transitions (common/timeline.py)
    <run_dir>/plots/*.png              deploy/plots.py

JSONL files are appended to by running processes, so a reader may meet a torn last line: it is skipped.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from common.timeline import read_timeline

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


def evals_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "evals.jsonl"


def processes_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "processes.jsonl"


def exit_times(run_dir: str | os.PathLike) -> dict[str, list[float]]:
    """Process name -> unix times at which it exited (from processes.jsonl)."""
    out: dict[str, list[float]] = {}
    for item in read_jsonl(processes_path(run_dir)):
        if item.get("event") == "exit" and isinstance(item.get("t"), int | float):
            out.setdefault(str(item.get("process")), []).append(float(item["t"]))
    return out


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


def timelines(run_dir: str | os.PathLike) -> dict[str, list[tuple[float, str]]]:
    """Process name -> its (unix time, state) transitions, learner first, then brokers and workers by name."""
    directory = Path(run_dir) / "timeline"
    found = {p.stem: read_timeline(p) for p in sorted(directory.glob("*.jsonl"))} if directory.is_dir() else {}
    order = sorted(found, key=lambda name: (name != "learner", name != "broker", name))
    return {name: found[name] for name in order if found[name]}


def busy_intervals(transitions: list[tuple[float, str]], end_s: float,
                   exits: list[float] = ()) -> list[tuple[float, float, str]]:
    """(start, end, state) spans from a process's transitions. A span ends at the next transition, or at the
    process's next exit (``exits``: a crash leaves a gap until the restarted process marks a state), or at
    ``end_s`` for the last one."""
    spans = []
    for (t, state), following in zip(transitions, [*transitions[1:], (end_s, "")], strict=True):
        end = min([following[0], *(x for x in exits if x >= t)])
        if end > t:
            spans.append((t, end, state))
    return spans


def busy_share(transitions: list[tuple[float, str]], end_s: float, exits: list[float] = ()) -> float | None:
    """Fraction of a process's time spent in a busy state, start-up and shut-down not counted (None before
    it was ready)."""
    spans = [s for s in busy_intervals(transitions, end_s, exits) if s[2] not in ("starting", "stopping")]
    total = sum(end - start for start, end, _ in spans)
    if total <= 0:
        return None
    return sum(end - start for start, end, state in spans if state in BUSY_STATES) / total
