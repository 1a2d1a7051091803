"""The single-process reference of bench/time_to_accuracy.py trains: two steps of bench.single_process on the tiny
model, with a coin-flip reward (keyed by the completion text) so that groups carry a learning signal."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bench.single_process import SingleProcess
from loraflow.common.config import load_config


def test_reference_loop_trains_and_serves_each_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = load_config(None, [f'model.path="{tiny_model_dir}"', 'run.task="arith"', "run.group_size=8",
                                "run.groups_per_step=2", "worker.max_new_tokens=4", "worker.chunk_tokens=4",
                                'worker.reward="tests.fault.rewards:coin"', "learner.lora_rank=4",
                                f'run.run_dir="{tmp_path / "run"}"'])
    loop = SingleProcess(config, adapter_root=tmp_path / "adapters", adapter_every=2, num_threads=1)
    try:
        before = [p.detach().clone() for p in loop.policy.trainable_parameters()]
        first = loop.step()
        assert first.version == 1 and first.num_samples == 16 and loop.backend.newest_version == 1
        assert first.num_groups_trained > 0, "no group had a learning signal"
        assert math.isfinite(first.loss)
        after = [p.detach() for p in loop.policy.trainable_parameters()]
        assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)), "the step changed nothing"
        second = loop.step()
        assert second.version == 2 and loop.cursor == 4  # each step leases new prompts
        # the backend serves what was trained: version 2, the learner's own bytes; v1 was unloaded
        from loraflow.learner import publish

        snap = publish.snapshot(loop.policy, version=2, step=2, is_main=True)
        assert loop.backend.newest_version == 2 and sorted(loop.backend.adapters) == [2]
        assert loop.backend.served(2).sha256 == snap.sha256
        assert sorted(loop.adapters) == [2] and (Path(loop.adapters[2]) / "adapter_config.json").is_file()
    finally:
        loop.close()
