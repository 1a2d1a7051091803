"""One torch thread for this package's in-process models: on a busy 2-core machine two spinning OpenMP threads
made a tiny forward pass 30x slower than one (measured here)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
