"""The policy check's free path (learner/step.py checked_train_step, learner/integrity.py TrainedCheck): tokens
claiming the version the parameters hold are checked from the training forward's own log-probs, with no
extra forward; a group failing there is not trained and the step is redone without it; older versions are
still re-scored before the step; with LoRA dropout the training forward is not an engine's, and every
version is re-scored. On the tiny model, float32, one process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loraflow.common.config import load_config
from loraflow.learner import data, publish
from loraflow.learner.integrity import IntegrityCheck
from loraflow.learner.loss import LossConfig
from loraflow.learner.model import build_policy
from loraflow.learner.parallel import init_parallel
from loraflow.learner.rescoring import eval_mode, stochastic_modules
from loraflow.learner.step import checked_train_step, forward_backward, make_optimizer, train_step
from tests.learner.scripted import Scorer, encode_groups, rollout_group, sample_group, served_for

OVERRIDES = ["learner.lora_rank=8", "learner.lr=0.05", "learner.warmup_steps=0", "learner.grad_clip=0",
             "learner.micro_batch_tokens=128", "integrity.samples_per_group=2", "run.max_staleness=2"]


class Learner:
    """A policy, its optimizer and its check, as the learner loop holds them (v0 recorded)."""

    def __init__(self, model_dir: Path, parallel, *extra: str) -> None:
        self.config = load_config(None, [*OVERRIDES, *extra])
        self.parallel = parallel
        self.policy = build_policy(model_dir, self.config.learner, parallel, seed=0)
        self.optimizer, self.scheduler = make_optimizer(self.policy, self.config.learner)
        self.check = IntegrityCheck(self.config, self.policy, parallel)
        self.check.watch(self.optimizer)
        self.check.record(0, "")
        self.loss_config = LossConfig.from_learner(self.config.learner)

    def checked(self, step: data.StepBatch):
        return checked_train_step(self.policy, self.optimizer, self.scheduler, step, check=self.check,
                                  parallel=self.parallel, config=self.config, loss_config=self.loss_config)

    def plain(self, step: data.StepBatch) -> None:
        train_step(self.policy, self.optimizer, self.scheduler, step, parallel=self.parallel, config=self.config,
                   loss_config=self.loss_config)

    def parameters(self) -> list[torch.Tensor]:
        return [p.to_local().detach().clone() for p in self.policy.trainable_parameters()]


@pytest.fixture(scope="module")
def parallel():
    parallel = init_parallel("cpu")
    yield parallel
    parallel.close()


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> Scorer:
    return Scorer(tiny_model_dir)


def honest(base: Scorer, rng: np.random.Generator, group_id: str, version: int = 0, sha256: str = "") -> tuple:
    return rollout_group(group_id, sample_group(base, rng, group_size=4, version=version),
                         [served_for(version, sha256)], worker_id=f"w-{group_id}")


def made_up(base: Scorer, rng: np.random.Generator, group_id: str, version: int = 0, sha256: str = "") -> tuple:
    samples = sample_group(base, rng, group_size=4, version=version)
    for s in samples:
        s.logprobs = np.full_like(s.logprobs, -0.5)
    return rollout_group(group_id, samples, [served_for(version, sha256)], worker_id="liar")


def batch(groups: list) -> data.StepBatch:
    return data.decode_step_batch(encode_groups(groups))


def test_a_batch_of_current_version_rows_runs_no_extra_forward(tiny_model_dir: Path, parallel, base: Scorer) -> None:
    learner = Learner(tiny_model_dir, parallel)
    rng = np.random.default_rng(0)
    step = batch([honest(base, rng, f"g{k}") for k in range(3)])
    assert learner.check.free_version == 0
    stats, trained, verdict = learner.checked(step)
    assert learner.check.rescorer.num_forwards == 0  # the free path: the training forward was the check
    assert verdict.mismatches == [] and verdict.keep == [0, 1, 2] and trained.num_groups == 3
    assert verdict.num_checked_tokens == 3 * 2 * 12  # 2 samples of each group, 12 tokens each
    assert verdict.max_passing_diff < 1e-4 and verdict.seconds > 0
    assert stats["num_tokens"] == 3 * 4 * 12
    # the step changed the parameters: they hold no version until the next publish, so v0 is re-scored
    assert learner.check.free_version is None
    learner.checked(batch([honest(base, rng, "after")]))
    assert learner.check.rescorer.num_forwards > 0


def test_training_forward_log_probs_equal_the_re_scoring_ones(tiny_model_dir: Path, parallel, base: Scorer) -> None:
    """The number the free path compares (the training forward, grad on, micro-batches of mixed lengths) vs the
    re-scoring forward (eval mode, no grad, the sample alone): float32, the largest difference over 48 samples."""
    learner = Learner(tiny_model_dir, parallel)
    rng = np.random.default_rng(1)
    groups = []
    for k in range(12):
        samples = sample_group(base, rng, group_size=4, version=0, prompt_len=int(rng.integers(3, 9)),
                               completion_len=int(rng.integers(4, 16)))
        groups.append(rollout_group(f"g{k}", samples, [served_for(0, "")]))
    step = batch(groups)
    seen: dict[int, torch.Tensor] = {}

    def observe(rows, logp):
        seen.update(zip(rows, logp.detach().split([step.samples[i].num_trained for i in rows]), strict=True))

    forward_backward(learner.policy, step, parallel=parallel, config=learner.config, loss_config=learner.loss_config,
                     observe=observe)
    assert sorted(seen) == list(range(len(step.samples)))
    worst = 0.0
    with eval_mode(learner.policy.model), torch.no_grad():
        for i, sample in enumerate(step.samples):
            mb = data.collate([sample], [0.0])
            alone, _ = learner.policy.trained_logprobs(mb.input_ids, mb.select, mb.targets[mb.select], 1.0,
                                                       with_entropy=False)
            worst = max(worst, float((alone - seen[i]).abs().max()))
    print(f"training forward vs re-scoring forward, fp32: max |diff| {worst:.2e} nats over {len(seen)} samples")
    assert worst < 1e-5  # the fp32 tolerance is 0.01


def test_a_failing_current_version_group_is_not_trained_and_the_step_is_redone(tiny_model_dir: Path, parallel,
                                                                             base: Scorer) -> None:
    rng = np.random.default_rng(2)
    groups = [honest(base, rng, "good-0"), made_up(base, rng, "bad"), honest(base, rng, "good-1")]
    checked, reference = Learner(tiny_model_dir, parallel), Learner(tiny_model_dir, parallel)
    assert all(torch.equal(a, b) for a, b in zip(checked.parameters(), reference.parameters(), strict=True))
    stats, trained, verdict = checked.checked(batch(groups))
    assert [(m.group_id, m.worker_id, m.reason) for m in verdict.mismatches] == [("bad", "liar", "logprobs")]
    assert verdict.keep == [0, 2] and trained.group_ids == ["good-0", "good-1"]
    assert checked.check.rescorer.num_forwards == 0 and checked.check.num_redone_steps == 1  # caught by the free path
    assert stats["num_tokens"] == 2 * 4 * 12
    reference.plain(data.keep_groups(batch(groups), [0, 2]))  # the step on the batch without that group
    after, expected = checked.parameters(), reference.parameters()
    assert any(not torch.equal(a, b) for a, b in zip(after, Learner(tiny_model_dir, parallel).parameters(),
                                                     strict=True))  # the step did train
    assert all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))


def test_older_versions_are_re_scored_before_the_step(tiny_model_dir: Path, parallel, base: Scorer) -> None:
    """After v1 is published, v0 groups are re-scored (forwards counted) and a failing one is dropped before
    the step (no redo); v1 groups go through the free path in the same step."""
    learner = Learner(tiny_model_dir, parallel)
    rng = np.random.default_rng(3)
    learner.plain(batch([honest(base, rng, f"warm-{k}") for k in range(2)]))
    snap = publish.snapshot(learner.policy, version=1, step=1, is_main=True)
    learner.check.record(1, snap.sha256)
    v1 = Scorer(tiny_model_dir, snap.tensors, learner.policy.lora_config)
    groups = [honest(base, rng, "old"), made_up(base, rng, "old-bad"),
              honest(v1, rng, "new", version=1, sha256=snap.sha256),
              made_up(v1, rng, "new-bad", version=1, sha256=snap.sha256)]
    _, trained, verdict = learner.checked(batch(groups))
    assert [(m.group_id, m.reason, m.version) for m in verdict.mismatches] == [("old-bad", "logprobs", 0),
                                                                                ("new-bad", "logprobs", 1)]
    assert trained.group_ids == ["old", "new"] and verdict.keep == [0, 2]
    assert learner.check.rescorer.num_forwards == 1  # one forward: the chosen v0 samples of both v0 groups
    assert learner.check.num_redone_steps == 1  # new-bad was caught by the training forward
    assert verdict.num_checked_tokens == 4 * 2 * 12


def test_with_lora_dropout_every_version_is_re_scored(tiny_model_dir: Path, parallel, base: Scorer) -> None:
    learner = Learner(tiny_model_dir, parallel, "learner.lora_dropout=0.1")
    assert stochastic_modules(learner.policy.model) and learner.check.free_version is None
    rng = np.random.default_rng(4)
    _, trained, verdict = learner.checked(batch([honest(base, rng, "good"), made_up(base, rng, "bad")]))
    assert [(m.group_id, m.reason) for m in verdict.mismatches] == [("bad", "logprobs")]
    assert trained.group_ids == ["good"]
    assert learner.check.rescorer.num_forwards > 0 and learner.check.num_redone_steps == 0
