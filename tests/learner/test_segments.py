"""Rows longer than the token budget (learner/segments.py): trained in segments, the numbers of the unsplit row.

- a step whose long rows are cut into segments of at most ``micro_batch_tokens`` gives the log-probs, the loss
  statistics and the LoRA gradients of the same step with a budget above every row, to 1e-5 in fp32 (tiny Llama,
  LoRA on every linear layer with a non-zero lora_B, so keys and values depend on the adapter), with and without
  activation checkpointing and the KL reference;
- no forward pass is wider than the budget;
- the ranks' pass sequences line up (every rank runs the same kinds in the same order, its own in order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraflow.common.config import load_config
from loraflow.learner import data, segments
from loraflow.learner.loss import LossConfig
from loraflow.learner.model import build_policy
from loraflow.learner.parallel import init_parallel
from loraflow.learner.step import forward_backward
from tests.support import run_ranks


@pytest.fixture(scope="module")
def parallel():
    p = init_parallel("cpu")
    yield p
    p.close()


def step_batch(lengths: list[tuple[int, int]], seed: int = 0) -> data.StepBatch:
    """One group per two samples of (prompt, completion) lengths, random tokens, some completion tokens masked."""
    g = torch.Generator().manual_seed(seed)
    samples, rewards = [], []
    for k, (prompt, completion) in enumerate(lengths):
        mask = torch.rand(completion, generator=g) > 0.2
        mask[0] = True
        samples.append(data.Sample(group=k // 2, tokens=torch.randint(0, 259, (prompt + completion,), generator=g),
                                   prompt_len=prompt, behaviour_logp=-5.5 + 0.3 * torch.randn(completion, generator=g),
                                   loss_mask=mask))
        rewards.append(float(k % 2) + 0.1 * k)
    num_groups = (len(lengths) + 1) // 2
    return data.StepBatch(batch_id="b", group_ids=[str(i) for i in range(num_groups)], min_versions=[0] * num_groups,
                          samples=samples, rewards=torch.tensor(rewards),
                          group_index=torch.tensor([s.group for s in samples]))


def run(model_dir: Path, parallel, step: data.StepBatch, *, budget: int, checkpointing: str, kl_beta: float):
    config = load_config(None, ["learner.lora_rank=4", 'learner.target_modules="all-linear"',
                                f"learner.micro_batch_tokens={budget}", f"learner.kl_beta={kl_beta}",
                                f"learner.activation_checkpointing={json.dumps(checkpointing)}"])
    policy = build_policy(model_dir, config.learner, parallel, seed=0)
    with torch.no_grad():  # a non-zero lora_B: the adapter changes the keys and values the segments share
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.to_local().normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    widths: list[int] = []
    original = policy.model.trained_logprobs  # the FSDP2 root's forward method every pass goes through

    def recording(input_ids, *args, **kwargs):
        widths.append(input_ids.numel())
        return original(input_ids, *args, **kwargs)

    policy.model.trained_logprobs = recording
    computed = forward_backward(policy, step, parallel=parallel, config=config,
                                loss_config=LossConfig.from_learner(config.learner),
                                observe=lambda rows, logp: seen.__setitem__(tuple(rows), logp.detach().clone()))
    grads = {n: p.grad.to_local().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return computed, seen, grads, widths


@pytest.mark.parametrize(("checkpointing", "kl_beta"), [("off", 0.0), ("on", 0.0), ("off", 0.1)])
def test_a_split_row_trains_as_the_unsplit_row(tiny_model_dir: Path, parallel, checkpointing: str,
                                               kl_beta: float) -> None:
    step = step_batch([(30, 120), (5, 60), (3, 9), (7, 20)])  # input lengths 149, 64, 11, 26
    budget = 40
    micro = data.rank_micro_batches(step, torch.ones(4), rank=0, world_size=1, budget_tokens=budget)
    assert sorted(len(mb.segments) - 1 for mb in micro if mb.segments) == [2, 4]  # 149 -> 4 pieces, 64 -> 2
    split, split_seen, split_grads, widths = run(tiny_model_dir, parallel, step, budget=budget,
                                                 checkpointing=checkpointing, kl_beta=kl_beta)
    whole, whole_seen, whole_grads, _ = run(tiny_model_dir, parallel, step, budget=1000,
                                            checkpointing=checkpointing, kl_beta=kl_beta)
    assert max(widths) <= budget
    assert len(whole_seen) == 1 and len(split_seen) == 4  # one micro-batch of all four rows / one per row
    split_rows, whole_rows = per_row(split_seen, step), per_row(whole_seen, step)
    assert split_rows.keys() == whole_rows.keys() == {0, 1, 2, 3}
    for row, want in whole_rows.items():
        torch.testing.assert_close(split_rows[row], want, rtol=0, atol=1e-5)
    # loss, clip, ratio and entropy sums, and the KL: every trained token's term, whatever the segment
    torch.testing.assert_close(split.sums, whole.sums, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(split.ratio_max, whole.ratio_max, rtol=0, atol=1e-5)
    assert split_grads.keys() == whole_grads.keys() and len(whole_grads) > 0
    for name, want in whole_grads.items():
        torch.testing.assert_close(split_grads[name], want, rtol=1e-4, atol=1e-5, msg=name)
    k_proj_a = [g for n, g in whole_grads.items() if "k_proj.lora_A" in n]
    assert k_proj_a and all(g.abs().max() > 1e-4 for g in k_proj_a)  # the keys' own adapter gets trained


def per_row(seen: dict[tuple[int, ...], torch.Tensor], step: data.StepBatch) -> dict[int, torch.Tensor]:
    """Sample index -> its trained log-probs, from what observe saw per micro-batch."""
    out = {}
    for rows, logp in seen.items():
        out.update(zip(rows, logp.split([step.samples[r].num_trained for r in rows]), strict=True))
    return out


def test_segment_bounds_cover_the_row_within_the_budget() -> None:
    for length in (1, 39, 40, 41, 149, 1000):
        for budget in (16, 40, 333):
            bounds = segments.segment_bounds(length, budget)
            assert bounds[0] == 0 and bounds[-1] == length
            widths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
            assert all(0 < w <= budget for w in widths) and max(widths) - min(widths) <= 1
            assert len(widths) == -(-length // budget)


@pytest.mark.parametrize("seed", range(20))
def test_aligned_passes_keep_each_ranks_order_and_run_the_same_kinds(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    world_size = 1 + seed % 4
    kinds = [[k for _ in range(int(torch.randint(0, 4, (1,), generator=g)))
              for k in segments.pass_kinds(int(torch.randint(1, 5, (1,), generator=g)), bool(seed % 2))]
             for _ in range(world_size)]
    schedules = [segments.aligned(kinds, rank) for rank in range(world_size)]
    assert len({tuple(kind for kind, _ in s) for s in schedules}) == 1  # one sequence of kinds on every rank
    for rank, schedule in enumerate(schedules):
        own = [i for _, i in schedule if i is not None]
        assert own == list(range(len(kinds[rank])))
        assert all(kinds[rank][i] == kind for kind, i in schedule if i is not None)
    longest = max(len(k) for k in kinds)
    assert len(schedules[0]) <= sum(len(k) for k in kinds) and len(schedules[0]) >= longest


def test_split_rows_on_two_ranks_train_as_unsplit(tiny_model_dir: Path) -> None:
    """Rank 0 splits a row in 4, rank 1 one in 2 and packs the rest: the passes line up (a mismatch would hang
    or mix the ranks' all-gathers) and each rank's numbers equal the unsplit step's."""
    assert "segments ok on 2 ranks" in run_ranks("segments_ranks.py", 2, str(tiny_model_dir))
