"""The LoRA gather behind every published adapter: one all_gather, the same tensors as torch's per-tensor
gather (``get_model_state_dict``), on 1, 2 and 3 ranks with row counts that do not divide evenly."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support import run_ranks


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_one_collective_gather_equals_torchs(ranks: int) -> None:
    assert f"gather ok on {ranks} ranks" in run_ranks("gather_ranks.py", ranks, timeout_s=180)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="renaming the machine for one job (a UTS namespace) needs root and unshare")
def test_ranks_on_one_host_whose_name_does_not_resolve() -> None:
    """torchrun names its store by the hostname by default: on a machine whose name resolves nowhere (a fresh
    container's) every rank retried it without end. One-host jobs reach it at 127.0.0.1 (one_host_torchrun)."""
    out = run_ranks("gather_ranks.py", 2, timeout_s=120, hostname="no-such-host.invalid")
    assert "gather ok on 2 ranks" in out


def test_parameters_that_are_not_row_shards_take_torchs_gather() -> None:
    """Not FSDP2 dim-0 shards (here plain tensors): gather_trainable declines on every rank alike, and the
    publish path falls back to get_model_state_dict."""
    from torch import nn

    from loraflow.learner.publish import gather_trainable

    assert gather_trainable(nn.Linear(3, 2), is_main=True) is None
    frozen = nn.Linear(3, 2).requires_grad_(False)
    assert gather_trainable(frozen, is_main=True) is None
