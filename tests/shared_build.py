"""Session artefacts built once for the whole test run, not once per pytest-xdist process.

Each xdist process has its own session, so a session fixture that builds a model builds it in every process
that needs it. :func:`built_once` builds into a directory next to the processes' own temporary directories,
under an exclusive file lock: the first process builds, the others wait on the lock and reuse what it left.
A build that failed leaves no ``.built`` marker, so the next process tries again (and fails with its own error).
"""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """``<run's temp root>/<name>``, built by ``build(directory)`` in the first process that asks for it."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base  # shared by the xdist processes of one run
    directory = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / ".built").is_file():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            (directory / ".built").touch()
    return directory
