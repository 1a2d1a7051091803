"""When each process was busy or waiting: state transitions appended to a JSONL file per process.

Each role marks its state changes (``timeline.mark("generating")``); a line ``{"t": unix_s, "state": ...}``
is written only when the state actually changes, so the file stays small however long the run. The
launcher's plots draw one lane per process from these files (``<run_dir>/timeline/<process>.jsonl``).
States are the protocol's ``CLIENT_STATES`` (idle, waiting, generating, scoring, training, publishing, ...).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class Timeline:
    """Appends state changes of one process to ``<run_dir>/timeline/<name>.jsonl`` (no-op without a path)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path else None
        self.state: str | None = None
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_process(cls, run_dir: str | os.PathLike, name: str) -> Timeline:
        return cls(Path(run_dir) / "timeline" / f"{name}.jsonl")

    def mark(self, state: str) -> None:
        with self._lock:
            if state == self.state:
                return
            self.state = state
            if self.path is None:
                return
            with open(self.path, "a") as f:
                f.write(json.dumps({"t": round(time.time(), 4), "state": state}) + "\n")


def read_timeline(path: str | os.PathLike) -> list[tuple[float, str]]:
    """(unix time, state) pairs of a timeline file, skipping a torn last line."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            item = json.loads(line)
            out.append((float(item["t"]), str(item["state"])))
        except (ValueError, KeyError, TypeError):
            continue
    return out
