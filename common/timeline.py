"""When each process was busy or waiting, and when it was alive: one JSONL file per process.

Each role marks its state changes (``timeline.mark("generating")``); a line is written only when the state
actually changes, so the file stays small however long the run. Four kinds of line::

    {"t": unix_s, "state": "starting", "pid": 123}   the first mark of a process: a life begins (a restart when
                                                     the file already holds one)
    {"t": unix_s, "state": "generating"}             a state change
    {"t": unix_s, "alive": 1}                        nothing else was written for ALIVE_EVERY_S: still there
    {"t": unix_s, "state": "stopped" | "exited"}     the final mark: ``close()`` on a clean stop, "exited" when the
                                                     interpreter ends without it (an exception, a start-up error)

A life ends at its last line. A process killed by a signal it cannot handle (SIGKILL, the OOM killer) writes no
final mark: its life ends at its last state change or alive line, at most ALIVE_EVERY_S before it died, and
never runs on to the end of the plot. The alive lines come from a daemon thread started at the first mark;
they say the process exists, not that it makes progress (its state says that).

States are the protocol's ``CLIENT_STATES`` (idle, waiting, generating, scoring, training, publishing, ...)
plus the two final marks. :func:`read_lives` parses a file; :mod:`loraflow.deploy.rundir` adds the launcher's exit
records and :mod:`loraflow.deploy.plots` draws one lane per process.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: seconds without a line after which the alive thread writes one (how far a killed process's lane may overrun)
ALIVE_EVERY_S = 1.0
#: the final marks: a clean stop, and an interpreter exit without one
STOPPED, EXITED = "stopped", "exited"
FINAL_STATES = frozenset({STOPPED, EXITED})


class Timeline:
    """Appends one process's states to ``<run_dir>/timeline/<name>.jsonl`` (no-op without a path).

    ``clock`` gives unix seconds (tests pass their own); ``alive_every_s = 0`` starts no alive thread (a test
    calls :meth:`keepalive` itself)."""

    def __init__(self, path: str | os.PathLike | None, *, clock: Callable[[], float] = time.time,
                 alive_every_s: float = ALIVE_EVERY_S) -> None:
        self.path = Path(path) if path else None
        self.state: str | None = None
        self.clock = clock
        self.alive_every_s = alive_every_s
        self._lock = threading.Lock()
        self._last_write_s: float | None = None  # None until the first mark
        self._closed = threading.Event()
        self._pid = os.getpid()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_process(cls, run_dir: str | os.PathLike, name: str) -> Timeline:
        return cls(Path(run_dir) / "timeline" / f"{name}.jsonl")

    def mark(self, state: str) -> None:
        with self._lock:
            if state == self.state or self._closed.is_set():
                return
            self.state = state
            first = self._last_write_s is None
            self._write({"state": state, "pid": self._pid} if first else {"state": state})
        if first and self.path is not None:
            atexit.register(self._at_exit)
            if self.alive_every_s > 0:
                threading.Thread(target=self._keep_alive, name="timeline-alive", daemon=True).start()

    def keepalive(self) -> None:
        """Write an alive line if nothing was written for ``alive_every_s`` (the alive thread calls this)."""
        with self._lock:
            if self._last_write_s is None or self._closed.is_set():
                return
            if self.clock() - self._last_write_s >= self.alive_every_s:
                self._write({"alive": 1})

    def close(self, final_state: str = STOPPED) -> None:
        """The final mark (a clean stop by default); later marks are ignored."""
        assert final_state in FINAL_STATES, final_state
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self._last_write_s is not None:
                self.state = final_state
                self._write({"state": final_state})
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        if os.getpid() == self._pid:  # not in a forked child that inherited the handler
            self.close(EXITED)

    def _keep_alive(self) -> None:
        while not self._closed.wait(self.alive_every_s):
            self.keepalive()

    def _write(self, fields: dict) -> None:
        now = self.clock()
        self._last_write_s = now
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"t": round(now, 4), **fields}) + "\n")


@dataclass(slots=True, kw_only=True)
class Life:
    """One process's life as its timeline tells it: from its first mark to its last sign of life."""

    start_s: float
    end_s: float  # the last line: final mark, last state change or last alive line
    pid: int = 0  # 0 in files written before lives were marked
    ended: str = ""  # a final mark (STOPPED, EXITED), or "" when the file has none (killed, or still running)
    transitions: list[tuple[float, str]] = field(default_factory=list)  # (unix time, state), final mark excluded

    def spans(self) -> list[tuple[float, float, str]]:
        """(begin, end, state): each state until the next change, the last one until the end of the life."""
        ends = [t for t, _ in self.transitions[1:]] + [self.end_s]
        return [(t, end, state) for (t, state), end in zip(self.transitions, ends, strict=True) if end > t]


def read_lives(path: str | os.PathLike) -> list[Life]:
    """The lives in a timeline file, in order, skipping lines that do not parse (a torn last line)."""
    lives: list[Life] = []
    for line in Path(path).read_text().splitlines():
        try:
            item = json.loads(line)
            t = float(item["t"])
            state = item.get("state")
            if state is not None and not isinstance(state, str):
                continue
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if "pid" in item or not lives or lives[-1].ended:  # a new process (or a file without pid marks)
            if state is None:
                continue  # an alive line with no life to belong to
            lives.append(Life(start_s=t, end_s=t, pid=int(item.get("pid") or 0)))
        life = lives[-1]
        life.end_s = max(life.end_s, t)
        if state in FINAL_STATES:
            life.ended = state
        elif state is not None and (not life.transitions or life.transitions[-1][1] != state):
            life.transitions.append((t, state))
    return [life for life in lives if life.transitions]


def read_timeline(path: str | os.PathLike) -> list[tuple[float, str]]:
    """(unix time, state) changes of a timeline file over all its lives, final marks excluded."""
    return [transition for life in read_lives(path) for transition in life.transitions]
