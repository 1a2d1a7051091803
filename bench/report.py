"""What the benchmarks share: the last line each prints (one JSON object with the figure and its same-run
reference), scratch directories that do not outlive the run, and the environment that runs another checkout's
code under the installed name."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "broker", "rollout_worker", "learner", "deploy")


def scratch_dir(prefix: str) -> str:
    """A new temporary directory, removed when the benchmark's process exits (for one that outlives a ``with``)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def checkout_env(tree: Path) -> dict[str, str]:
    """The environment of a child process whose ``loraflow`` is ``tree``'s code (``bench`` and ``tests``: this one's).

    This checkout's code is the installed one. Another checkout's top-level folders are linked under a ``loraflow``
    folder of a scratch directory first on PYTHONPATH, which Python searches before the installed package's finder."""
    tree = Path(tree).resolve()
    paths = [str(REPO)]
    if tree != REPO:
        root = Path(scratch_dir("loraflow-tree-"))
        (root / "loraflow").mkdir()
        for name in PACKAGES:
            (root / "loraflow" / name).symlink_to(tree / name, target_is_directory=True)
        paths.insert(0, str(root))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def report(bench: str, metric: str, value: float, unit: str, reference: float, ratio: float | None = None,
           **extra: Any) -> None:
    """Print ``{"bench", "metric", "value", "unit", "reference", "ratio", ...}`` as the final output line."""
    if ratio is None:
        ratio = value / reference if reference else float("nan")
    line = {"bench": bench, "metric": metric, "value": round(value, 6), "unit": unit,
            "reference": round(reference, 6), "ratio": round(ratio, 4), **extra}
    sys.stdout.flush()
    print(json.dumps(line), flush=True)
