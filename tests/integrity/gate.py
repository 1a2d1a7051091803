"""The faulty client's join gate: ``LORAFLOW_FAULT_GATE`` names a file the test creates when the client may join.

The client process starts with the run and does its imports meanwhile (torch, transformers, the worker: up to
half a minute on a busy 2-core machine), then waits here; once the file exists it runs as if just started, so
the fault still begins after the learner's first versions while joining costs only the connect and model load.
"""

from __future__ import annotations

import os
import time

ENV = "LORAFLOW_FAULT_GATE"


def wait() -> None:
    """Return once the gate file exists (at once without ``LORAFLOW_FAULT_GATE``)."""
    gate = os.environ.get(ENV)
    while gate and not os.path.exists(gate):
        time.sleep(0.05)
