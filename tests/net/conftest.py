"""Fixtures of the multi-host tests: the bed needs root and iproute2, and says so by failing, never by skipping.

CI runs as root; on a machine where that is not so, deselect the suite with ``-m "not net"``.
"""

from __future__ import annotations

import pytest

from bench.netns import BedUnavailable, require_root


@pytest.fixture(scope="session")
def root_and_ip() -> None:
    try:
        require_root()
    except BedUnavailable as exc:
        pytest.fail(f"{exc} (the 'net' tests need it; deselect them with -m 'not net' on a machine without it)")
