"""The row-sharded embedding and head (learner/vocab.py) equal the whole matrix's numbers on 1, 2 and 3 ranks."""

from __future__ import annotations

import pytest

from tests.support import run_ranks


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_sharded_vocab_rows_give_the_whole_matrixs_numbers(ranks: int) -> None:
    assert f"vocab ok on {ranks} ranks" in run_ranks("vocab_ranks.py", ranks, timeout_s=180)
