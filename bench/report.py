"""The last line every benchmark prints: one JSON object with the figure and its same-run reference."""

from __future__ import annotations

import json
import sys
from typing import Any


def report(bench: str, metric: str, value: float, unit: str, reference: float, ratio: float | None = None,
           **extra: Any) -> None:
    """Print ``{"bench", "metric", "value", "unit", "reference", "ratio", ...}`` as the final output line."""
    if ratio is None:
        ratio = value / reference if reference else float("nan")
    line = {"bench": bench, "metric": metric, "value": round(value, 6), "unit": unit,
            "reference": round(reference, 6), "ratio": round(ratio, 4), **extra}
    sys.stdout.flush()
    print(json.dumps(line), flush=True)
