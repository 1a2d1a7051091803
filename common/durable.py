"""Durability on disk: what the atomic writers (temp file or directory, fsync, rename) share."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
