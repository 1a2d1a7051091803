"""Rollout groups, from the broker's Batch message to the padded micro-batches each rank trains on.

    rank 0      Batch (broker) --select_groups--> which groups to train, skip (counted) and acknowledge
                               --trainable_frames--> the same message holding only the groups to train
    all ranks   Parallel.broadcast_frames --decode_step_batch--> StepBatch (samples, rewards, groups, evidence)
                --learner.integrity--> the groups that pass the policy check (--keep_groups--> only those;
                                       rank 0: --refuse_groups--> the others skipped as policy_mismatch)
                --assign_to_ranks--> this rank's samples (balanced by length)
                --plan_micro_batches--> its micro-batches (token budget, longest first; a row longer than
                                        the budget alone, cut into segments of <= budget: loraflow.learner.segments)
                --collate--> MicroBatch tensors
                --rank_pass_kinds--> every rank's forward passes, lined up by loraflow.learner.segments.aligned (each
                                     forward is collective: a rank with nothing to run runs an empty pass)

Rank 0 is the single authority on what is trained: it alone keeps the trained group ids and the policy
version. Other ranks just decode the message it broadcasts, so every rank sees the same samples in the same
order and the micro-batch plan (a pure function of it) is identical everywhere.

A sample is ``prompt + completion`` tokens. The model reads ``tokens[:-1]`` and predicts ``tokens[1:]``; a
completion token is trained when its ``loss_mask`` is 1 (environment tokens of multi-turn tasks have 0: they
are read, never trained). Rows are right-padded: with causal attention a real token never attends to padding,
so no attention mask is needed and positions stay 0..L-1.

The token budget (``learner.micro_batch_tokens``) bounds every forward pass: rows x longest row <= budget for
packed rows (sorted by length, so padding stays small: the rows of a micro-batch are neighbours in length), and
a longer row runs in segments of at most the budget, each attending to the earlier segments' keys and values
(:mod:`loraflow.learner.segments`: the same log-probs, loss and gradients as the unsplit row). What a long row still
costs beside its segment's activations is its keys and values and their gradients, kept for the whole row: for
the Qwen2-1.5B shape in bf16, 2 x 28 layers x 2 KV heads x 128 = 14,336 values per token, 8 bytes each (bf16,
an fp32 gradient, the running segment's bf16 leaf gradient): 112 KiB per token, 3.5 GiB for one 32k-token
sample (measured on the 0.5B layer shape: BENCHMARKS.md "Learner memory").
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loraflow.common import codec, framing, group_checks, protocol, versions
from loraflow.common.codes import ProtocolError
from loraflow.common.framing import TensorSpec
from loraflow.common.group_checks import GROUP_TENSORS
from loraflow.common.protocol import Batch, BatchEntry
from loraflow.learner.loss import group_advantages
from loraflow.learner.segments import pass_kinds, segment_bounds

NUM_GROUP_TENSORS = len(GROUP_TENSORS)
#: why a group of a batch is not trained; the first two are still acknowledged as trained
SKIP_REASONS = ("already_trained", "zero_variance", "stale", "invalid", "withdrawn", "policy_mismatch")
ACKED_SKIPS = ("already_trained", "zero_variance")


# -- rank 0: which groups to train -----------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Selection:
    """What rank 0 decided about each group of a batch."""

    train: list[int] = field(default_factory=list)       # entry indices of the groups to train, batch order
    ack_group_ids: list[str] = field(default_factory=list)  # trained + already trained + zero variance
    skipped: collections.Counter = field(default_factory=collections.Counter)  # reason -> groups
    skipped_ids: dict[str, list[str]] = field(default_factory=dict)  # reason -> group ids, batch order
    token_versions: dict[str, list[int]] = field(default_factory=dict)  # the distinct versions of each
                                                                        # acknowledged new group's tokens
    staleness: collections.Counter = field(default_factory=collections.Counter)  # staleness (of the newest
                                                                                 # token) -> trained groups


def select_groups(batch: Batch, specs: Sequence[TensorSpec], frames: Sequence[Any], *, version: int,
                  max_staleness: int, trained_group_ids: set[str], vocab_size: int,
                  scale_by_std: bool = True, withdrawn: Sequence[tuple[int, int]] = ()) -> Selection:
    """Decide per group: train it, or skip it with a reason (see SKIP_REASONS).

    - ``already_trained``: its id is in ``trained_group_ids`` or earlier in this batch (acknowledged again);
    - ``stale``: ``version - max_version > max_staleness``, no token within the bound (not acknowledged: the broker
      re-queues the prompt; the older tokens of a group kept are masked, loraflow.learner.data.mask_stale_tokens);
    - ``invalid``: tensor contents out of range or an empty prompt (not acknowledged);
    - ``withdrawn``: a token was generated under a version in ``withdrawn`` (rolled back when this learner
      resumed; the broker drops such groups too, this is the learner's own guard; not acknowledged);
    - ``zero_variance``: all rewards equal, no learning signal (acknowledged: the prompt is done).
    """
    out = Selection()
    seen: set[str] = set()
    candidates: list[int] = []

    def skip(reason: str, group_id: str) -> None:
        out.skipped[reason] += 1
        out.skipped_ids.setdefault(reason, []).append(group_id)

    for i, entry in enumerate(batch.groups):
        group = entry.group
        if group.group_id in trained_group_ids or group.group_id in seen:
            skip("already_trained", group.group_id)
            out.ack_group_ids.append(group.group_id)
            continue
        seen.add(group.group_id)
        if versions.group_is_too_stale(version, group.min_version, group.max_version, max_staleness):
            skip("stale", group.group_id)
            continue
        group_specs = specs[entry.first_tensor:entry.first_tensor + NUM_GROUP_TENSORS]
        try:
            group_checks.check_group_values(group, group_specs, frames, vocab_size=vocab_size,
                                        latest_version=max(version, group.max_version))
            if min(group.prompt_lens) < 1:
                raise ProtocolError(f"RolloutGroup {group.group_id}: a sample has an empty prompt", "invalid_group")
        except ProtocolError:
            skip("invalid", group.group_id)
            continue
        spec = next(s for s in group_specs if s.name == "versions")
        token_versions = framing.as_numpy(spec, frames[spec.frame])
        if withdrawn and versions.overlaps(withdrawn, group.min_version, group.max_version) \
                and versions.touches(withdrawn, token_versions):
            skip("withdrawn", group.group_id)
            continue
        out.token_versions[group.group_id] = [int(v) for v in np.unique(token_versions)]
        candidates.append(i)
    if candidates:
        rewards = [r for i in candidates for r in batch.groups[i].group.rewards]
        index = [k for k, i in enumerate(candidates) for _ in batch.groups[i].group.rewards]
        _, zero_variance = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(index),
                                            len(candidates), scale_by_std=scale_by_std)
        for k, i in enumerate(candidates):
            group = batch.groups[i].group
            out.ack_group_ids.append(group.group_id)
            if zero_variance[k]:
                skip("zero_variance", group.group_id)
            else:
                out.train.append(i)
                out.staleness[versions.staleness(version, group.max_version)] += 1
    return out


def refuse_groups(selection: Selection, batch: Batch, failed: Sequence[int], *, version: int) -> None:
    """Take the step batch's groups ``failed`` (indices into ``selection.train``) out of what rank 0 trains and
    acknowledges: skipped as ``policy_mismatch`` (loraflow.learner.integrity), so the broker re-queues their prompts."""
    entries = [selection.train[k] for k in failed]
    refused = {batch.groups[i].group.group_id for i in entries}
    selection.train = [i for i in selection.train if i not in set(entries)]
    selection.ack_group_ids = [g for g in selection.ack_group_ids if g not in refused]
    for i in entries:
        group = batch.groups[i].group
        selection.skipped["policy_mismatch"] += 1
        selection.skipped_ids.setdefault("policy_mismatch", []).append(group.group_id)
        selection.token_versions.pop(group.group_id, None)
        staleness = versions.staleness(version, group.max_version)
        selection.staleness[staleness] -= 1
        if selection.staleness[staleness] <= 0:
            del selection.staleness[staleness]


def trainable_frames(batch: Batch, specs: Sequence[TensorSpec], frames: Sequence[Any],
                     train: Sequence[int]) -> list[Any]:
    """Frames of a Batch message holding only the entries ``train`` (tensor frames forwarded, not copied)."""
    entries, new_specs, new_frames = [], [], []
    for i in train:
        entry = batch.groups[i]
        entries.append(BatchEntry(group=entry.group, first_tensor=len(new_specs)))
        for spec in specs[entry.first_tensor:entry.first_tensor + NUM_GROUP_TENSORS]:
            new_specs.append(TensorSpec(spec.name, spec.dtype, spec.shape, len(new_frames)))
            new_frames.append(frames[spec.frame])
    record = Batch(batch_id=batch.batch_id, groups=entries, latest_version=batch.latest_version)
    return codec.encode_with_frames(record, new_specs, new_frames)


# -- every rank: samples and micro-batches ---------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Sample:
    group: int                    # index of its group in the step batch
    tokens: torch.Tensor          # [P + C] int64, prompt then completion
    prompt_len: int               # P >= 1
    behaviour_logp: torch.Tensor  # [C] f32
    loss_mask: torch.Tensor       # [C] bool
    versions: torch.Tensor | None = None  # [C] int64, the version each completion token claims (None: made by
                                          # hand, e.g. a benchmark: nothing to check against)

    @property
    def num_trained(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def input_len(self) -> int:
        return self.tokens.numel() - 1


@dataclass(slots=True, kw_only=True)
class StepBatch:
    batch_id: str
    group_ids: list[str]         # [G]
    min_versions: list[int]      # [G]
    samples: list[Sample]        # [N], group by group
    rewards: torch.Tensor        # [N] f32
    group_index: torch.Tensor    # [N] int64
    worker_ids: list[str] = field(default_factory=list)                           # [G], as each group says
    served: list[list[protocol.ServedAdapter]] = field(default_factory=list)      # [G], its evidence
    worker_sessions: list[str] = field(default_factory=list)  # [G], the submitting process (set by the broker)

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    @property
    def num_trained_tokens(self) -> int:
        return sum(s.num_trained for s in self.samples)


def decode_step_batch(frames: Sequence[Any]) -> StepBatch:
    """The samples of a (filtered) Batch message, copied out of the frames."""
    batch, envelope = codec.decode(frames)
    assert isinstance(batch, Batch), f"expected a Batch, got {type(batch).__name__}"
    samples: list[Sample] = []
    rewards: list[float] = []
    for g, entry in enumerate(batch.groups):
        group = entry.group
        tensors = group_checks.group_tensors(envelope.specs[entry.first_tensor:entry.first_tensor + NUM_GROUP_TENSORS],
                                         envelope.frames)
        prompts = tensors["prompt_ids"].long().split(group.prompt_lens)
        completions = tensors["completion_ids"].long().split(group.completion_lens)
        logps = tensors["logprobs"].float().split(group.completion_lens)
        masks = tensors["loss_mask"].bool().split(group.completion_lens)
        token_versions = tensors["versions"].long().split(group.completion_lens)
        for prompt, completion, logp, mask, version in zip(prompts, completions, logps, masks, token_versions,
                                                           strict=True):
            samples.append(Sample(group=g, tokens=torch.cat([prompt, completion]), prompt_len=prompt.numel(),
                                  behaviour_logp=logp.clone(), loss_mask=mask.clone(), versions=version.clone()))
        rewards.extend(group.rewards)
    groups = [e.group for e in batch.groups]
    return StepBatch(batch_id=batch.batch_id, group_ids=[g.group_id for g in groups],
                     min_versions=[g.min_version for g in groups], samples=samples,
                     rewards=torch.tensor(rewards, dtype=torch.float32),
                     group_index=torch.tensor([s.group for s in samples], dtype=torch.int64),
                     worker_ids=[g.worker_id for g in groups], served=[list(g.served) for g in groups],
                     worker_sessions=[g.worker_session for g in groups])


def keep_groups(step: StepBatch, keep: Sequence[int]) -> StepBatch:
    """The step batch of only the groups ``keep`` (indices, in order): the policy check's survivors."""
    new_index = {g: k for k, g in enumerate(keep)}
    samples = [Sample(group=new_index[s.group], tokens=s.tokens, prompt_len=s.prompt_len,
                      behaviour_logp=s.behaviour_logp, loss_mask=s.loss_mask, versions=s.versions)
               for s in step.samples if s.group in new_index]
    kept = [i for i, s in enumerate(step.samples) if s.group in new_index]
    return StepBatch(batch_id=step.batch_id, group_ids=[step.group_ids[g] for g in keep],
                     min_versions=[step.min_versions[g] for g in keep], samples=samples,
                     rewards=step.rewards[kept], group_index=torch.tensor([s.group for s in samples], dtype=torch.int64),
                     worker_ids=[step.worker_ids[g] for g in keep], served=[step.served[g] for g in keep],
                     worker_sessions=[step.worker_sessions[g] for g in keep] if step.worker_sessions else [])


def plan_micro_batches(input_lens: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """Sample indices per micro-batch: longest first, rows x longest row <= budget (a longer row goes alone)."""
    order = sorted(range(len(input_lens)), key=lambda i: (-input_lens[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        if current and (len(current) + 1) * max(width, input_lens[i]) > budget_tokens:
            plan.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, input_lens[i])
    if current:
        plan.append(current)
    return plan


def assign_to_ranks(costs: Sequence[int], world_size: int) -> list[list[int]]:
    """Item indices per rank, costliest first to the least-loaded rank (ties to the lower rank)."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        out[rank].append(i)
        loads[rank] += costs[i]
    return out


@dataclass(slots=True, kw_only=True)
class MicroBatch:
    input_ids: torch.Tensor       # [B, L] int64, right-padded with 0
    targets: torch.Tensor         # [B, L] int64, the next token at each position
    select: torch.Tensor          # [B, L] bool, positions whose target is a trained completion token
    behaviour_logp: torch.Tensor  # [T] f32, behaviour log-probs of the selected targets (row-major order)
    advantages: torch.Tensor      # [T] f32, the advantage of each selected target's sample
    num_samples: int
    rows: tuple[int, ...] = ()    # [B] the step batch's sample index of each row (set by rank_micro_batches)
    segments: tuple[int, ...] = ()  # (0, b_1, .., L): a single row longer than the budget, run in these pieces

    @property
    def num_tokens(self) -> int:
        """Trained tokens T."""
        return int(self.select.sum())

    @property
    def num_positions(self) -> int:
        """Positions computed, padding included (B x L)."""
        return self.input_ids.numel()

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(input_ids=self.input_ids.to(device), targets=self.targets.to(device),
                          select=self.select.to(device), behaviour_logp=self.behaviour_logp.to(device),
                          advantages=self.advantages.to(device), num_samples=self.num_samples, rows=self.rows,
                          segments=self.segments)


def collate(samples: Sequence[Sample], advantages: Sequence[float]) -> MicroBatch:
    """Right-padded rows of the samples; an empty list gives a one-position row that trains nothing."""
    width = max((s.input_len for s in samples), default=1)
    rows = max(len(samples), 1)
    input_ids = torch.zeros(rows, width, dtype=torch.int64)
    targets = torch.zeros(rows, width, dtype=torch.int64)
    select = torch.zeros(rows, width, dtype=torch.bool)
    behaviour, adv = [], []
    for row, (sample, a) in enumerate(zip(samples, advantages, strict=True)):
        n = sample.input_len
        input_ids[row, :n] = sample.tokens[:-1]
        targets[row, :n] = sample.tokens[1:]
        start = sample.prompt_len - 1  # the position that predicts the first completion token
        select[row, start:n] = sample.loss_mask
        behaviour.append(sample.behaviour_logp[sample.loss_mask])
        adv.append(torch.full((sample.num_trained,), float(a), dtype=torch.float32))
    return MicroBatch(input_ids=input_ids, targets=targets, select=select,
                      behaviour_logp=torch.cat(behaviour) if behaviour else torch.zeros(0),
                      advantages=torch.cat(adv) if adv else torch.zeros(0), num_samples=len(samples))


def _rank_plans(step: StepBatch, world_size: int, budget_tokens: int) -> list[list[list[int]]]:
    """Per rank, its micro-batches as sample indices: samples spread over the ranks by length (balanced), then
    planned per rank by the token budget."""
    trainable = [i for i, s in enumerate(step.samples) if s.num_trained > 0]
    per_rank = [[trainable[k] for k in mine]
                for mine in assign_to_ranks([step.samples[i].input_len for i in trainable], world_size)]
    return [[[samples[k] for k in mb] for mb in plan_micro_batches([step.samples[i].input_len for i in samples],
                                                                  budget_tokens)]
            for samples in per_rank]


def _num_segments(step: StepBatch, rows: Sequence[int], budget_tokens: int) -> int:
    return len(segment_bounds(step.samples[rows[0]].input_len, budget_tokens)) - 1 if len(rows) == 1 else 1


def rank_micro_batches(step: StepBatch, advantages: torch.Tensor, *, rank: int, world_size: int,
                       budget_tokens: int) -> list[MicroBatch]:
    """This rank's micro-batches of a step; a row longer than the budget is one micro-batch whose ``segments``
    cut it into pieces of at most ``budget_tokens`` (:mod:`loraflow.learner.segments`). The ranks may get different
    numbers: :func:`rank_pass_kinds` and :func:`loraflow.learner.segments.aligned` line their forward passes up."""
    out = []
    for mb in _rank_plans(step, world_size, budget_tokens)[rank]:
        micro = collate([step.samples[i] for i in mb], [float(advantages[i]) for i in mb])
        bounds = segment_bounds(micro.input_ids.shape[1], budget_tokens) if len(mb) == 1 else ()
        out.append(dataclasses.replace(micro, rows=tuple(mb), segments=bounds if len(bounds) > 2 else ()))
    return out


def rank_pass_kinds(step: StepBatch, *, world_size: int, budget_tokens: int, with_reference: bool) -> list[list[str]]:
    """Per rank, the kinds of the forward passes its micro-batches need (:func:`loraflow.learner.segments.pass_kinds`)."""
    return [[kind for mb in plan for kind in pass_kinds(_num_segments(step, mb, budget_tokens), with_reference)]
            for plan in _rank_plans(step, world_size, budget_tokens)]


def mask_stale_tokens(step: StepBatch, version: int, max_staleness: int) -> int:
    """Loss mask 0 on the completion tokens older than the bound (:func:`loraflow.common.versions.stale_tokens`): a
    sample of ``continue`` spans versions and its early tokens may have aged past ``max_staleness`` while it
    generated; they stay in the context the model reads, and are not trained. Returns how many trained tokens
    were masked. Every rank calls it with the same batch and version, before the policy check: a masked token is
    not checked either (its version may be older than the check's history holds; every token left to train is
    of a version it holds)."""
    oldest = versions.oldest_trainable(version, max_staleness)
    if all(v >= oldest for v in step.min_versions):
        return 0  # the common case, without a tensor op (a group's versions lie in its checked range)
    num_masked = 0
    for sample in step.samples:
        if sample.versions is None or step.min_versions[sample.group] >= oldest:
            continue
        stale = sample.loss_mask & versions.stale_tokens(sample.versions, version, max_staleness)   # [C] bool
        count = int(stale.sum())
        if count:
            sample.loss_mask = sample.loss_mask & ~stale
            num_masked += count
    return num_masked
