"""The learner's side of the staleness rule (issue 13): a group is trained while its newest token is within
max_staleness; its tokens older than the bound get loss mask 0 (read as context, never trained), counted."""

from __future__ import annotations

import numpy as np
import torch

from loraflow.common import codec
from loraflow.common.protocol import Batch, BatchEntry
from loraflow.learner import data, evidence
from loraflow.learner.data import mask_stale_tokens
from tests.learner.scripted import make_group

VOCAB = 259


def spanning(rng: np.random.Generator, group_id: str, token_versions: list[list[int]]) -> tuple:
    """A group whose sample k's completion tokens carry ``token_versions[k]`` (its lengths follow)."""
    group, tensors = make_group(rng, group_id, group_size=len(token_versions))
    lens = [len(v) for v in token_versions]
    n = sum(lens)
    group.completion_lens = lens
    flat = np.array([v for sample in token_versions for v in sample], dtype=np.int32)
    group.min_version, group.max_version = int(flat.min()), int(flat.max())
    mask = np.ones(n, dtype=np.uint8)
    mask[1] = 0  # an environment token: never trained, whatever its version
    arrays = {"prompt_ids": tensors[0][1], "completion_ids": rng.integers(0, VOCAB, n, dtype=np.int32),
              "logprobs": np.full(n, -2.0, dtype=np.float32), "versions": flat, "loss_mask": mask}
    return group, list(arrays.items())


def step_of(groups: list[tuple], *, version: int, max_staleness: int) -> tuple[data.Selection, data.StepBatch]:
    entries, tensors = [], []
    for group, group_tensors in groups:
        entries.append(BatchEntry(group=group, first_tensor=len(tensors)))
        tensors.extend(group_tensors)
    frames = codec.encode(Batch(batch_id="b", groups=entries), tensors)
    batch, envelope = codec.decode(frames)
    selection = data.select_groups(batch, envelope.specs, envelope.frames, version=version,
                                   max_staleness=max_staleness, trained_group_ids=set(), vocab_size=VOCAB)
    train = data.trainable_frames(batch, envelope.specs, envelope.frames, selection.train)
    return selection, data.decode_step_batch([bytearray(f) for f in train])


def test_a_long_sample_spanning_versions_is_trained_with_its_stale_tokens_masked() -> None:
    rng = np.random.default_rng(0)
    long_sample = [3] * 5 + [4] * 5 + [5] * 5 + [6] * 5  # generated while the learner went from 3 to 6
    groups = [spanning(rng, "0:0", [long_sample, [3, 3, 3]]),  # its short sibling ended at v3: all stale
              spanning(rng, "0:1", [[4, 4, 5], [5, 5, 6]]),
              spanning(rng, "0:2", [[3, 3, 4], [4, 4]])]  # no token within the bound: not trained, re-queued
    selection, step = step_of(groups, version=6, max_staleness=1)
    assert [step.group_ids[g] for g in range(step.num_groups)] == ["0:0", "0:1"]
    assert dict(selection.skipped) == {"stale": 1} and selection.ack_group_ids == ["0:0", "0:1"]
    assert dict(selection.staleness) == {0: 2}  # a group's staleness is its newest token's
    trained_before = [s.num_trained for s in step.samples]
    num_masked = mask_stale_tokens(step, version=6, max_staleness=1)
    masks = [s.loss_mask.int().tolist() for s in step.samples]
    assert masks[0] == [0] * 10 + [1] * 10  # v3, v4 tokens masked (the env token at 1 was 0 already)
    assert masks[1] == [0, 0, 0]
    assert masks[2] == [0, 0, 1] and masks[3] == [1, 1, 1]  # v4 is 2 behind 6; its second token was an env one
    assert num_masked == sum(trained_before) - sum(s.num_trained for s in step.samples) == 9 + 3 + 1
    # the context is untouched: the tokens the model reads are the ones generated
    assert [s.tokens.numel() - s.prompt_len for s in step.samples] == [20, 3, 3, 3]
    # what the loss sees: only the trained tokens, and every one of a version the policy check holds
    advantages = torch.ones(len(step.samples))
    (micro,) = data.rank_micro_batches(step, advantages, rank=0, world_size=1, budget_tokens=4096)
    assert micro.num_tokens == step.num_trained_tokens == 10 + 1 + 3
    facts = evidence.step_facts(step)
    trained_versions = {int(v) for i in range(len(step.samples)) for v in facts.trained_versions(i)[0]}
    assert trained_versions == {5, 6}


def test_nothing_to_mask_costs_no_tensor_op_and_changes_nothing() -> None:
    rng = np.random.default_rng(1)
    _, step = step_of([spanning(rng, "0:0", [[5, 6], [6, 6, 6]])], version=6, max_staleness=1)
    before = [s.loss_mask.clone() for s in step.samples]
    assert mask_stale_tokens(step, version=6, max_staleness=1) == 0
    assert all(torch.equal(a, s.loss_mask) for a, s in zip(before, step.samples, strict=True))
    assert mask_stale_tokens(step, version=7, max_staleness=0) == 4  # every trained token (the env one was not)
    assert step.num_trained_tokens == 0
