"""Learner test settings: one torch thread in this process (two spin against each other on a busy 2-core box,
and the learner processes the tests start get one each from tests.support.child_env)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
