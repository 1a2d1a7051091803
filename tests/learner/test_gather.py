"""The LoRA gather behind every published adapter: one all_gather, the same tensors as torch's per-tensor
gather (``get_model_state_dict``), on 1, 2 and 3 ranks with row counts that do not divide evenly."""

from __future__ import annotations

import pytest

from tests.support import run_ranks


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_one_collective_gather_equals_torchs(ranks: int) -> None:
    assert f"gather ok on {ranks} ranks" in run_ranks("gather_ranks.py", ranks, timeout_s=180)


def test_parameters_that_are_not_row_shards_take_torchs_gather() -> None:
    """Not FSDP2 dim-0 shards (here plain tensors): gather_trainable declines on every rank alike, and the
    publish path falls back to get_model_state_dict."""
    from torch import nn

    from loraflow.learner.publish import gather_trainable

    assert gather_trainable(nn.Linear(3, 2), is_main=True) is None
    frozen = nn.Linear(3, 2).requires_grad_(False)
    assert gather_trainable(frozen, is_main=True) is None
