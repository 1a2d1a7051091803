"""What the benchmarks share: the last line each prints (one JSON object with the figure and its same-run
reference) and scratch directories that do not outlive the run."""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
from typing import Any


def scratch_dir(prefix: str) -> str:
    """A new temporary directory, removed when the benchmark's process exits (for one that outlives a ``with``)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def report(bench: str, metric: str, value: float, unit: str, reference: float, ratio: float | None = None,
           **extra: Any) -> None:
    """Print ``{"bench", "metric", "value", "unit", "reference", "ratio", ...}`` as the final output line."""
    if ratio is None:
        ratio = value / reference if reference else float("nan")
    line = {"bench": bench, "metric": metric, "value": round(value, 6), "unit": unit,
            "reference": round(reference, 6), "ratio": round(ratio, 4), **extra}
    sys.stdout.flush()
    print(json.dumps(line), flush=True)
