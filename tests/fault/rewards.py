"""A reward for fault-injection runs: a fair coin keyed by the completion text (sim workers generate random
tokens, so any real task would score every sample 0 and no group would carry a learning signal)."""

from __future__ import annotations

import zlib
from typing import Any


def coin(completion: str, answer: str, **_context: Any) -> float:
    return float(zlib.crc32(completion.encode(errors="replace")) & 1)
