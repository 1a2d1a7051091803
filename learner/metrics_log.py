"""The learner's per-step metrics: one dict per optimizer step, emitted in one place.

``<run_dir>/learner/metrics.jsonl`` (rank 0) gets one JSON object per step. :meth:`MetricsLog.emit` stamps it
with the learner process it comes from, so a restart's history can be read back truthfully::

    {"step": 7, "version": 8, ..., "session": "3f2a...", "resumed_step": 4}

``session`` is the id this learner process said hello with (``Hello.session``, also in ``ledger.jsonl``'s
start line); ``resumed_step`` the step of the checkpoint it resumed from (0 for a fresh start). A learner that
dies loses the steps after its newest checkpoint, and its successor trains those step numbers again. So a line
of session S with step n is *withdrawn* when a later line belongs to another session whose ``resumed_step`` is
below n: the file is append-only (a killed learner cannot mend it, and a fenced one may still be appending),
and the mark is the successor's ``resumed_step``. :func:`loraflow.deploy.rundir.learner_history` applies the rule and
gives the committed history, each step once.

Other sinks of a step's metrics (an experiment tracker) are callables taking the same dict, given as ``sinks``;
they see exactly what the file gets, after it is written. The loop calls :meth:`emit` once per step; what goes
into the dict is the loop's business (learner/train.py builds it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Sink = Callable[[dict[str, Any]], None]


class MetricsLog:
    """Writes a learner session's step metrics (rank 0; other ranks hold one without a path and no sinks)."""

    def __init__(self, path: Path | None, *, session: str, resumed_step: int, sinks: Sequence[Sink] = ()) -> None:
        self.path = path
        self.session = session
        self.resumed_step = resumed_step
        self.sinks = list(sinks)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """One step's metrics (must hold ``step``): appended to the file, then handed to every sink."""
        assert isinstance(metrics.get("step"), int), metrics.get("step")
        line = {**metrics, "session": self.session, "resumed_step": self.resumed_step}
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        for sink in self.sinks:
            sink(line)
        return line
