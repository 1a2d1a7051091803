"""The row-sharded embedding and head (learner/vocab.py) equal the whole matrix's numbers on 1, 2 and 3 ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO, child_env


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_sharded_vocab_rows_give_the_whole_matrixs_numbers(ranks: int) -> None:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={ranks}", str(REPO / "tests" / "learner" / "vocab_ranks.py")],
                            capture_output=True, text=True, timeout=180, env=child_env(), cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"vocab ok on {ranks} ranks" in result.stdout
