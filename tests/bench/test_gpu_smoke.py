"""The GPU placement bench/gpu_smoke.sh uses (bench.gpu_smoke.placement), with fake device lists: the part of the
GPU smoke run that can be checked without a GPU besides its CPU mode."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.gpu_smoke import NUM_WORKERS, placement, span


@pytest.mark.parametrize("visible", [("0",), ("0", "1"), ("0", "1", "2"), ("0", "1", "2", "3"),
                                     tuple(str(i) for i in range(8)), ("GPU-a", "MIG-GPU-b/1/0")])
def test_three_vllm_workers_fit_on_their_gpus(visible: tuple[str, ...]) -> None:
    where, util, ranks = placement(visible)
    assert len(where.learner) == ranks == (2 if len(visible) >= 3 else 1)
    assert len(where.workers) == NUM_WORKERS and all(len(ids) == 1 for ids in where.workers)
    engines = Counter(ids[0] for ids in where.workers)
    assert set(engines) <= set(visible)
    for device, count in engines.items():
        budget = 0.75 if device in where.learner else 0.85  # the learner keeps a quarter of a GPU it shares
        assert count * util <= budget + 1e-9, (device, count, util)
    if len(visible) >= ranks + NUM_WORKERS:  # enough GPUs: one per worker, none beside the learner
        assert len(engines) == NUM_WORKERS and not set(engines) & set(where.learner) and util == 0.85
    else:
        assert max(engines.values()) > 1


def test_span_shows_breaks_in_version_numbers() -> None:
    assert span([1, 2, 3, 5, 6, 6]) == "1..3, 5..6, 6"
    assert span([]) == ""
