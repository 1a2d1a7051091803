"""The learner's ledger: an append-only record of what each learner process trained and published.

``<run_dir>/learner/ledger.jsonl`` (rank 0), one JSON object per line, three kinds::

    {"event": "start", "session", "step", "version", "checkpoint_version", "next_version", "withdrawn"}
        a learner process began at ``step`` with the weights of ``checkpoint_version`` (0 / 0 for a fresh
        start); versions above it that were already published are ``withdrawn`` ([lo, hi] ranges) and the
        next one it publishes is ``next_version``
    {"event": "publish", "version", "step", "sha256", "num_bytes"}
        an adapter version sent to the broker (the weights after ``step``)
    {"event": "step", "step", "batch_id", "trained_version", "trained", "zero_variance", "already_trained",
     "not_acked", "versions", "workers"}
        one optimizer step: the group ids trained, acknowledged without a gradient (zero reward variance,
        or trained before), skipped and left to the broker to re-queue (stale, invalid, withdrawn tokens), and
        the distinct policy versions of each trained or zero-variance group's tokens, and the worker each trained
        group came from (as the broker names the process that submitted it)

What it is for: the *committed history* of a run is the chain of steps its newest checkpoint descends from.
Reading the ledger in order and cutting the chain back to ``step`` at every ``start`` line gives exactly that
chain, so the claim "every prompt of an epoch trained exactly once, none from a withdrawn version, no version
number reused with other weights" can be checked after any crash (tests/fault does).

Order of writes within a step: ``publish`` and ``step`` lines are written before the checkpoint that may
follow and before the BatchAck, so a checkpoint never covers a step the ledger lacks (a step written but lost
with the process is cut by the next ``start``). Lines are flushed, not fsynced: the ledger survives a killed
process (the case it is for), not a lost machine. It costs one short line per step and per version.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Ledger:
    """Appends ledger lines to one file (rank 0 only; other ranks hold a ledger without a path)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def _write(self, line: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({**line, "time_unix": round(time.time(), 3)}, separators=(",", ":")) + "\n")

    def start(self, *, session: str, step: int, version: int, checkpoint_version: int, next_version: int,
              withdrawn: Sequence[tuple[int, int]]) -> None:
        self._write({"event": "start", "session": session, "step": step, "version": version,
                     "checkpoint_version": checkpoint_version, "next_version": next_version,
                     "withdrawn": [list(r) for r in withdrawn]})

    def publish(self, *, version: int, step: int, sha256: str, num_bytes: int) -> None:
        self._write({"event": "publish", "version": version, "step": step, "sha256": sha256, "num_bytes": num_bytes})

    def step(self, *, step: int, batch_id: str, trained_version: int, trained: Sequence[str],
             zero_variance: Sequence[str], already_trained: Sequence[str], not_acked: Sequence[str],
             versions: dict[str, list[int]], workers: dict[str, str] | None = None) -> None:
        self._write({"event": "step", "step": step, "batch_id": batch_id, "trained_version": trained_version,
                     "trained": list(trained), "zero_variance": list(zero_variance),
                     "already_trained": list(already_trained), "not_acked": list(not_acked),
                     "versions": versions, "workers": workers or {}})


def newest_published(path: Path | None, tail_bytes: int = 1 << 20) -> int:
    """The highest version a ``publish`` line names (0 if none): a restarted learner numbers after it, so a
    version it sent before dying, even one the broker never received, is never reused for other weights.
    Reads the file's tail (publish lines come every step); the whole file only if the tail holds none."""
    if path is None or not path.is_file():
        return 0
    size = path.stat().st_size
    with open(path, "rb") as f:
        for start in ((max(0, size - tail_bytes), 0) if size > tail_bytes else (0,)):
            f.seek(start)
            found = [line["version"] for line in _parse(f.read().decode(errors="replace"))
                     if line.get("event") == "publish"]
            if found:
                return max(found)
    return 0


def _parse(text: str) -> list[dict[str, Any]]:
    lines = []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed process, or the cut first line of a tail
        if isinstance(line, dict):
            lines.append(line)
    return lines


def read(path: Path) -> list[dict[str, Any]]:
    """The ledger's lines (a torn last line from a killed process is ignored)."""
    return _parse(path.read_text()) if path.is_file() else []
