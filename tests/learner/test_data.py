"""loraflow.learner.data: group selection, re-encoded batches, micro-batch planning, rank assignment, collation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraflow.common import codec
from loraflow.common.protocol import Batch, BatchEntry
from loraflow.learner import data, segments
from tests.learner.scripted import make_batch, make_group


def decoded(frames):
    record, envelope = codec.decode(frames)
    return record, envelope.specs, envelope.frames


def batch_of(groups_and_tensors) -> list:
    entries, tensors = [], []
    for group, group_tensors in groups_and_tensors:
        entries.append(BatchEntry(group=group, first_tensor=len(tensors)))
        tensors.extend(group_tensors)
    return codec.encode(Batch(batch_id="b", groups=entries), tensors)


def test_select_groups_skips_and_counts_each_reason() -> None:
    rng = np.random.default_rng(0)
    fresh = make_group(rng, "0:0", group_size=4, min_version=5)
    trained = make_group(rng, "0:1", group_size=4, min_version=5)
    stale = make_group(rng, "0:2", group_size=4, min_version=2)
    flat = make_group(rng, "0:3", group_size=4, min_version=5)
    flat[0].rewards = [1.0] * 4
    bad = make_group(rng, "0:4", group_size=4, min_version=5)
    bad[1][0][1][0] = 400  # a prompt token id outside the vocabulary
    duplicate = make_group(rng, "0:0", group_size=4, min_version=5)
    frames = batch_of([fresh, trained, stale, flat, bad, duplicate])
    batch, specs, tensor_frames = decoded(frames)
    selection = data.select_groups(batch, specs, tensor_frames, version=6, max_staleness=2,
                                   trained_group_ids={"0:1"}, vocab_size=259)
    assert selection.train == [0]
    assert dict(selection.skipped) == {"already_trained": 2, "stale": 1, "invalid": 1, "zero_variance": 1}
    # trained, zero-variance and already-trained groups are acknowledged; stale and invalid ones are re-queued
    assert sorted(selection.ack_group_ids) == ["0:0", "0:0", "0:1", "0:3"]
    assert dict(selection.staleness) == {1: 1}


def test_trainable_frames_keep_only_the_selected_groups_bit_for_bit() -> None:
    frames = make_batch(0, 3, num_groups=3, group_size=4)
    batch, specs, tensor_frames = decoded(frames)
    filtered = data.trainable_frames(batch, specs, tensor_frames, [0, 2])
    step = data.decode_step_batch(filtered)
    full = data.decode_step_batch(frames)
    assert step.batch_id == "batch-3" and step.group_ids == ["3:0", "3:2"]
    expected = [s for s in full.samples if s.group in (0, 2)]
    assert len(step.samples) == len(expected) == 8
    for got, want in zip(step.samples, expected, strict=True):
        assert torch.equal(got.tokens, want.tokens) and got.prompt_len == want.prompt_len
        assert torch.equal(got.behaviour_logp, want.behaviour_logp) and torch.equal(got.loss_mask, want.loss_mask)
    assert step.group_index.tolist() == [0] * 4 + [1] * 4
    assert step.rewards.tolist() == [r for g in (0, 2) for r in batch.groups[g].group.rewards]
    empty = data.decode_step_batch(data.trainable_frames(batch, specs, tensor_frames, []))
    assert empty.samples == [] and empty.num_trained_tokens == 0


@pytest.mark.parametrize("budget", [16, 40, 100, 1000])
def test_plan_respects_the_token_budget(budget: int) -> None:
    rng = np.random.default_rng(budget)
    lens = [int(x) for x in rng.integers(1, 60, 37)]
    plan = data.plan_micro_batches(lens, budget)
    assert sorted(i for mb in plan for i in mb) == list(range(37))
    for mb in plan:
        width = max(lens[i] for i in mb)
        assert len(mb) * width <= budget or len(mb) == 1  # a row longer than the budget goes alone (in segments)


def test_a_row_longer_than_the_budget_is_one_micro_batch_in_segments() -> None:
    samples = [data.Sample(group=0, tokens=torch.arange(n) % 200, prompt_len=2, behaviour_logp=torch.zeros(n - 2),
                           loss_mask=torch.ones(n - 2, dtype=torch.bool)) for n in (101, 31, 17)]
    step = data.StepBatch(batch_id="b", group_ids=["0"], min_versions=[0], samples=samples,
                          rewards=torch.zeros(3), group_index=torch.zeros(3, dtype=torch.int64))
    micro = data.rank_micro_batches(step, torch.ones(3), rank=0, world_size=1, budget_tokens=40)
    assert [mb.rows for mb in micro] == [(0,), (1,), (2,)]
    assert micro[0].segments == (0, 33, 67, 100) and micro[1].segments == micro[2].segments == ()
    assert data.rank_pass_kinds(step, world_size=1, budget_tokens=40, with_reference=False) == [
        ["N", "N", "G", "G", "G", "G", "G"]]


def test_assign_to_ranks_balances_the_load() -> None:
    costs = [100, 90, 50, 40, 30, 5, 1]
    for world_size in (1, 2, 3, 4, 8):
        out = data.assign_to_ranks(costs, world_size)
        assert sorted(i for rank in out for i in rank) == list(range(len(costs)))
        loads = [sum(costs[i] for i in rank) for rank in out]
        # longest-processing-time-first: within 4/3 of the best possible makespan
        assert max(loads) <= 4 / 3 * max(sum(costs) / world_size, max(costs))


def test_collate_aligns_targets_mask_and_behaviour() -> None:
    sample = data.Sample(group=0, tokens=torch.tensor([10, 11, 12, 20, 21, 22]), prompt_len=3,
                         behaviour_logp=torch.tensor([-1.0, -2.0, -3.0]), loss_mask=torch.tensor([True, False, True]))
    short = data.Sample(group=0, tokens=torch.tensor([5, 6, 7]), prompt_len=2, behaviour_logp=torch.tensor([-4.0]),
                        loss_mask=torch.tensor([True]))
    mb = data.collate([sample, short], [0.5, -1.0])
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21], [5, 6, 0, 0, 0]]
    assert mb.targets.tolist() == [[11, 12, 20, 21, 22], [6, 7, 0, 0, 0]]
    # position 2 predicts token 20 (completion 0), position 4 predicts 22 (completion 2); 21 is masked out
    assert mb.select.tolist() == [[False, False, True, False, True], [False, True, False, False, False]]
    assert mb.targets[mb.select].tolist() == [20, 22, 7]
    assert mb.behaviour_logp.tolist() == [-1.0, -3.0, -4.0]
    assert mb.advantages.tolist() == [0.5, 0.5, -1.0]
    assert mb.num_tokens == 3 and mb.num_positions == 10
    empty = data.collate([], [])
    assert empty.num_tokens == 0 and empty.input_ids.shape == (1, 1) and empty.behaviour_logp.numel() == 0


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_trained_sample_lands_on_exactly_one_rank(world_size: int) -> None:
    step = data.decode_step_batch(make_batch(1, 0, num_groups=4, group_size=4))
    advantages = torch.arange(len(step.samples), dtype=torch.float32)
    per_rank = [data.rank_micro_batches(step, advantages, rank=r, world_size=world_size, budget_tokens=48)
                for r in range(world_size)]
    kinds = data.rank_pass_kinds(step, world_size=world_size, budget_tokens=48, with_reference=False)
    assert [len(mbs) for mbs in per_rank] == [len(k) for k in kinds]  # one forward+backward per micro-batch
    # the same number of forward passes on every rank: the shorter ranks run empty ones
    assert len({len(segments.aligned(kinds, r)) for r in range(world_size)}) == 1
    if world_size > 1:  # the work is spread: no rank trains everything
        assert all(0 < sum(mb.num_tokens for mb in mbs) < step.num_trained_tokens for mbs in per_rank)
    tokens = sum(mb.num_tokens for mbs in per_rank for mb in mbs)
    assert tokens == step.num_trained_tokens
    seen = sorted(a for mbs in per_rank for mb in mbs for a in set(mb.advantages.tolist()))
    expected = sorted(float(i) for i, s in enumerate(step.samples) if s.num_trained)
    assert seen == expected
