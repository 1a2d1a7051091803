"""The live progress line of a run, from the broker's stats and the learner's metrics file.

    [  48s] step 41  v41  reward 0.63  acc 72.0% (v40)  1.9k tok/s  buffer 9/32  staleness 0:12 1:4
            learner busy 58%  workers 2  [reward failed 12]

Sources: one ``StatsRequest`` to the broker (:func:`loraflow.common.transport.fetch_stats`; versions, buffer depth,
token rate, learner busy share, workers, and the samples whose reward or environment failed, summed over the
connected workers' heartbeat counters, shown only when there are any) and the new lines of
``<run_dir>/learner/metrics.jsonl`` (step, mean reward, staleness of what was trained), read incrementally. Held-out accuracy is fed in by whoever measures it
(the launcher). A source that is not there yet (broker still starting, no step yet) shows as ``-``.

On a terminal the line is redrawn in place and events (a restarted worker, a measurement) are printed above
it; into a file or pipe, a line is printed every ``every_s`` seconds.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from loraflow.common.transport import BrokerUnavailable, fetch_stats
from loraflow.deploy import rundir


@dataclass(slots=True, kw_only=True)
class Snapshot:
    """What one progress line shows; None = not known yet."""

    elapsed_s: float = 0.0
    step: int | None = None
    version: int | None = None
    reward_mean: float | None = None
    accuracy: float | None = None
    accuracy_version: int | None = None
    tokens_per_s: float | None = None
    buffer_groups: int | None = None
    capacity_groups: int | None = None
    staleness: dict[str, int] = field(default_factory=dict)
    learner_busy_share: float | None = None
    num_workers: int | None = None
    reward_failures: int = 0  # samples scored 0 because the reward or environment failed (connected workers)


class MetricsTail:
    """Reads the lines appended to a JSONL file since the last call (a torn last line waits for the next)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


class Progress:
    """Collects a :class:`Snapshot` from the broker and the learner's metrics file."""

    def __init__(self, run_dir: str | Path, endpoint: str = "", *, reward_window: int = 5, security: Any = None,
                 run: str = "") -> None:
        self.endpoint = endpoint
        self.run = run  # the pool run whose broker picture is shown ("" = the broker's own)
        self.security = security
        self.tail = MetricsTail(rundir.metrics_path(run_dir))
        self.started_s = time.monotonic()
        self.recent_rewards: list[float] = []
        self.reward_window = reward_window
        self.snapshot = Snapshot()
        self.last_step: dict[str, Any] = {}

    def set_accuracy(self, accuracy: float, version: int) -> None:
        self.snapshot.accuracy, self.snapshot.accuracy_version = accuracy, version

    def poll(self, stats_timeout_s: float = 1.0) -> Snapshot:
        snap = self.snapshot
        snap.elapsed_s = time.monotonic() - self.started_s
        for line in self.tail.read_new():
            self.last_step = line
            if isinstance(line.get("reward_mean"), int | float):
                self.recent_rewards = [*self.recent_rewards, float(line["reward_mean"])][-self.reward_window:]
        if self.last_step:
            snap.step = self.last_step.get("step")
            snap.version = self.last_step.get("version")
            snap.staleness = dict(self.last_step.get("staleness") or {})
        if self.recent_rewards:
            snap.reward_mean = sum(self.recent_rewards) / len(self.recent_rewards)
        if self.endpoint:  # a broker that is starting or restarting keeps the last known figures
            with contextlib.suppress(BrokerUnavailable, ValueError):
                self.apply_stats(fetch_stats(self.endpoint, timeout_s=stats_timeout_s, security=self.security,
                                             run=self.run))
        return snap

    def apply_stats(self, stats: dict[str, Any]) -> None:
        snap = self.snapshot
        snap.version = max(snap.version or 0, int(stats.get("latest_version", 0)))
        buffer = stats.get("buffer") or {}
        snap.buffer_groups = buffer.get("groups")
        snap.capacity_groups = (stats.get("settings") or {}).get("capacity_groups")
        snap.tokens_per_s = (stats.get("rates") or {}).get("tokens_per_s")
        snap.learner_busy_share = stats.get("learner_busy_share")
        snap.num_workers = len(stats.get("workers") or [])
        snap.reward_failures = sum(int((w.get("counters") or {}).get("reward_failures") or 0)
                                   for w in stats.get("workers") or [])
        learner = stats.get("learner") or {}
        if isinstance(learner.get("step"), int) and learner["step"] > (snap.step or 0):
            snap.step = learner["step"]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def render(snap: Snapshot) -> str:
    """One progress line."""
    accuracy = "-" if snap.accuracy is None else f"{snap.accuracy:.1%} (v{snap.accuracy_version})"
    buffer = _num(snap.buffer_groups, "d")
    if snap.buffer_groups is not None and snap.capacity_groups:
        buffer += f"/{snap.capacity_groups}"
    staleness = " ".join(f"{k}:{v}" for k, v in sorted(snap.staleness.items(), key=lambda kv: int(kv[0]))) or "-"
    busy = "-" if snap.learner_busy_share is None else f"{snap.learner_busy_share:.0%}"
    return (f"[{snap.elapsed_s:5.0f}s] step {_num(snap.step, 'd')}  v{_num(snap.version, 'd')}  "
            f"reward {_num(snap.reward_mean, '.2f')}  acc {accuracy}  {_rate(snap.tokens_per_s)} tok/s  "
            f"buffer {buffer}  staleness {staleness}  learner busy {busy}  workers {_num(snap.num_workers, 'd')}"
            + (f"  reward failed {snap.reward_failures}" if snap.reward_failures else ""))


class Display:
    """Writes progress lines and events: in place on a terminal, periodically into files and pipes."""

    def __init__(self, stream: TextIO | None = None, *, every_s: float = 10.0, interactive: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.every_s = every_s
        self._last_line_s = -float("inf")
        self._status_shown = False

    def status(self, line: str, *, force: bool = False) -> None:
        if self.interactive:
            self.stream.write("\r\x1b[2K" + line)
            self._status_shown = True
        elif force or time.monotonic() - self._last_line_s >= self.every_s:
            self.stream.write(line + "\n")
            self._last_line_s = time.monotonic()
        self.stream.flush()

    def event(self, line: str) -> None:
        if self.interactive and self._status_shown:
            self.stream.write("\r\x1b[2K")
            self._status_shown = False
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive and self._status_shown:
            self.stream.write("\n")
            self._status_shown = False
        self.stream.flush()
