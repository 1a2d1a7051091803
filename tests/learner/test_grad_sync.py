"""Gradient sync once per step: FSDP2 reduces gradients in the last micro-batch's backward only.

A step split into several micro-batches runs as many gradient reductions as a step of one micro-batch (one per
parameter group with trainable parameters), and trains the same gradient (the loss weighs every token 1 / N).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from loraflow.common.config import load_config
from loraflow.learner import data
from loraflow.learner.loss import LossConfig
from loraflow.learner.model import build_policy
from loraflow.learner.parallel import init_parallel
from loraflow.learner.step import make_optimizer, train_step
from tests.learner.scripted import make_batch


@pytest.fixture(scope="module")
def parallel():
    p = init_parallel("cpu")
    yield p
    p.close()


def test_one_reduction_per_group_per_step_whatever_the_micro_batches(tiny_model_dir: Path, parallel,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = _fsdp_param_group.foreach_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", counting)
    results = {}
    for budget in (64, 100_000):
        config = load_config(None, ["learner.lora_rank=8", f"learner.micro_batch_tokens={budget}",
                                    "learner.grad_clip=0", f"learner.target_modules={json.dumps(['q_proj'])}"])
        policy = build_policy(tiny_model_dir, config.learner, parallel, seed=0)
        optimizer, scheduler = make_optimizer(policy, config.learner)
        batch = data.decode_step_batch(make_batch(7, 0, num_groups=2, group_size=4))
        micro = data.rank_micro_batches(batch, __import__("torch").ones(len(batch.samples)), rank=0, world_size=1,
                                        budget_tokens=budget)
        calls.clear()
        stats = train_step(policy, optimizer, scheduler, batch, parallel=parallel, config=config,
                           loss_config=LossConfig.from_learner(config.learner))
        results[budget] = (len(micro), len(calls), stats)
    (many, many_calls, many_stats), (one, one_calls, one_stats) = results[64], results[100_000]
    assert many > 2 and one == 1
    assert many_calls == one_calls == 4  # one per decoder layer (the root group holds no LoRA parameter)
    assert many_stats["grad_norm"] == pytest.approx(one_stats["grad_norm"], rel=1e-5)
    assert many_stats["loss"] == pytest.approx(one_stats["loss"], rel=1e-5, abs=1e-7)
