"""Activation checkpointing under FSDP2 on 2 ranks (the GPU default, learner.activation_checkpointing = auto)
trains what one process without it trains: same losses and gradient norms step by step, on the scripted
broker's batches (recomputing a layer in backward, inside FSDP2's hooks, changes nothing but memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.learner.scripted import ScriptedBroker
from tests.learner.test_learner_runs import NUM_STEPS, learner_argv, metrics_lines
from tests.support import Processes

RUN_TOKEN = 'security.run_token="checkpointing-test"'  # the scripted broker writes no run token file


def test_two_ranks_with_checkpointing_equal_one_rank_without(tiny_model_dir: Path, tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    runs = {}
    try:
        for name, ranks, setting in (("one", 1, "off"), ("two", 2, "on")):
            broker = ScriptedBroker(seed=11)
            try:
                proc = procs.spawn(name, learner_argv(tmp_path / name, broker.endpoint, tiny_model_dir,
                                                      f"run.num_steps={NUM_STEPS}", RUN_TOKEN,
                                                      f'learner.activation_checkpointing="{setting}"', ranks=ranks))
                assert proc.wait(240) == 0, proc.log()[-4000:]
            finally:
                broker.close()
            runs[name] = metrics_lines(tmp_path / name)
    finally:
        procs.cleanup()
    assert [m["step"] for m in runs["one"]] == [m["step"] for m in runs["two"]] == list(range(1, NUM_STEPS + 1))
    for one, two in zip(runs["one"], runs["two"], strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        assert one["grad_norm"] > 0
