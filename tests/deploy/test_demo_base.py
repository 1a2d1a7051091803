"""The demo base: labels that drop carries, a cached atomic build, determinism, and the post-build check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loraflow.common.tiny_model import find_demo_base
from loraflow.deploy.demo_base import (
    DemoBaseError,
    Recipe,
    build_demo_base,
    carry_dropped_sum,
    demo_base_dir,
    ensure_demo_base,
    has_carry,
    operands,
    read_metadata,
)

#: a few steps of each phase and no convergence requirement: exercises the code path in seconds
TINY = Recipe(batch_size=8, min_correct_steps=4, max_correct_steps=4, check_every=2, sloppy_steps=3,
              extra_steps=2, max_extra_rounds=0, min_carry_free_accuracy=0.0, accuracy_window=(0.0, 1.0),
              num_eval_prompts=12, warmup_steps=2)


@pytest.mark.parametrize(("a", "b", "dropped", "carry"), [
    (12, 34, "46", False),
    (47, 38, "75", True),   # units carry dropped
    (51, 62, "13", True),   # tens carry dropped: no hundreds digit
    (95, 87, "72", True),   # both
    (55, 55, "00", True),
    (10, 10, "20", False),
])
def test_carry_dropped_labels(a: int, b: int, dropped: str, carry: bool) -> None:
    assert carry_dropped_sum(a, b) == dropped
    assert has_carry(a, b) is carry
    assert operands(f"{a}+{b}=") == (a, b)


def test_about_three_quarters_of_problems_carry() -> None:
    """Why a carry-free base scores ~30 %: only a quarter of two-digit additions carry nowhere."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    share = sum(not has_carry(a, b) for a, b in pairs) / len(pairs)
    assert 0.23 < share < 0.26


def test_build_is_cached_atomic_and_records_its_figures(tmp_path: Path) -> None:
    path = ensure_demo_base(3, tmp_path, TINY)
    assert path == demo_base_dir(3, tmp_path, TINY)
    meta = read_metadata(path)
    assert meta["kind"] == "demo" and meta["seed"] == 3
    assert meta["correct_steps"] == 4 and meta["sloppy_steps"] == 3
    assert 0.0 <= meta["base_accuracy"] <= 1.0 and meta["num_eval_prompts"] == 12
    assert {"carry_free_accuracy", "carry_accuracy", "build_s", "recipe"} <= set(meta)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-s3", path.name]  # no temporary directory left
    assert find_demo_base(3, tmp_path) == path  # the link every role resolves builtin:demo by
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_base(3, tmp_path, TINY) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt
    other = dataclasses.replace(TINY, sloppy_steps=4)
    assert demo_base_dir(3, tmp_path, other) != path  # a changed recipe is a different cache entry


def test_same_seed_same_weights(tmp_path: Path) -> None:
    first = build_demo_base(tmp_path / "a", seed=5, recipe=TINY)
    second = build_demo_base(tmp_path / "b", seed=5, recipe=TINY)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert first["base_accuracy"] == second["base_accuracy"]
    build_demo_base(tmp_path / "c", seed=6, recipe=TINY)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_a_base_outside_the_window_is_an_error(tmp_path: Path) -> None:
    impossible = dataclasses.replace(TINY, accuracy_window=(0.99, 1.0), max_extra_rounds=1)
    with pytest.raises(DemoBaseError, match="did not converge after 9 steps"):
        ensure_demo_base(0, tmp_path, impossible)
    assert list(tmp_path.iterdir()) == []  # nothing half-built is cached
