"""One torch thread in the test process, for the packages whose conftest imports :func:`one_torch_thread`.

On a busy 2-core machine two spinning OpenMP threads made a tiny forward pass 30x slower than one (measured
here); the processes the tests start get one thread each from ``tests.support.child_env``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
