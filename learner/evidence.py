"""What the policy check (:mod:`loraflow.learner.integrity`) reads of a step batch, and the evidence rules of a
group: no forward, every group, every step.

    StepFacts        each group's sample indices and distinct token versions, each sample's trained tokens by
                     version, in one vectorised pass over the batch
    check_evidence   per group: a ServedAdapter for every version in its tokens (else no_evidence); its sha256 is
                     the one this learner published for that version while the history holds it (adapter_sha256;
                     rank 0 alone publishes, so only rank 0 knows the hashes); its int lora_id named no other
                     version earlier from the same worker process (lora_id_reused, :class:`LoraIds`)

``lora_id_reused`` keys on the worker process (:func:`process_of`): ``RolloutGroup.worker_id`` and
``worker_session``, which the broker sets in every Batch from the Hello session of the process that submitted the
group (a worker restarted under the same ``worker.id`` numbers its loads from 1 again, and is a new process, not
a reuse). A group's evidence is only compared, never trusted to index anything.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraflow.common.protocol import PolicyMismatch, ServedAdapter
from loraflow.learner import data
from loraflow.learner.rescoring import AdapterHistory

#: lora ids remembered per worker, and workers remembered (least recently seen forgotten first)
IDS_PER_WORKER = 64
MAX_WORKERS = 4096


class LoraIds:
    """Which version each (worker, lora_id) named first: an id that later names another version is reused.
    Bounded: the last :data:`IDS_PER_WORKER` ids per worker, the last :data:`MAX_WORKERS` workers seen."""

    def __init__(self, ids_per_worker: int = IDS_PER_WORKER, max_workers: int = MAX_WORKERS) -> None:
        self._ids_per_worker = ids_per_worker
        self._max_workers = max_workers
        self._workers: collections.OrderedDict[str, collections.OrderedDict[int, int]] = collections.OrderedDict()

    def claim(self, worker_id: str, lora_id: int, version: int) -> int | None:
        """Record the claim; the other version ``lora_id`` named earlier, or None."""
        ids = self._workers.get(worker_id)
        if ids is None:
            ids = self._workers[worker_id] = collections.OrderedDict()
            while len(self._workers) > self._max_workers:
                self._workers.popitem(last=False)
        self._workers.move_to_end(worker_id)
        earlier = ids.get(lora_id)
        if earlier is not None and earlier != version:
            return earlier
        ids[lora_id] = version
        ids.move_to_end(lora_id)
        while len(ids) > self._ids_per_worker:
            ids.popitem(last=False)
        return None


def process_of(step: data.StepBatch, group: int) -> str:
    """The worker process that submitted a group: its worker id and Hello session."""
    return f"{step.worker_ids[group]}#{step.worker_sessions[group] if step.worker_sessions else ''}"


def group_members(step: data.StepBatch) -> list[list[int]]:
    """The indices (into ``step.samples``) of each group's samples."""
    members: list[list[int]] = [[] for _ in range(step.num_groups)]
    for i, sample in enumerate(step.samples):
        members[sample.group].append(i)
    return members


@dataclass(slots=True, kw_only=True)
class StepFacts:
    """What the check reads of a step batch's samples, in one vectorised pass (a per-sample tensor op costs
    ~5 us: a few per sample of a 128-sample batch would be a millisecond, a share of a small step)."""

    members: list[list[int]]        # [G] each group's sample indices
    num_trained: list[int]          # [N]
    group_versions: list[list[int]]  # [G] the distinct versions of each group's completion tokens
    versions: np.ndarray            # every sample's token versions, concatenated (-1 where a sample has none)
    masks: np.ndarray               # every sample's loss mask, concatenated
    behaviour: np.ndarray           # every sample's behaviour log-probs, concatenated
    starts: np.ndarray              # [N + 1] where each sample's tokens start in those

    def trained_versions(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(distinct versions, token count of each) of sample ``i``'s trained tokens."""
        trained = self.versions[self.starts[i]:self.starts[i + 1]][self.masks[self.starts[i]:self.starts[i + 1]]]
        return _distinct(trained)

    def claimed(self, i: int, version: int) -> tuple[np.ndarray, np.ndarray]:
        """(mask over sample ``i``'s trained tokens of those claiming ``version``, their behaviour log-probs)."""
        span = slice(self.starts[i], self.starts[i + 1])
        mask = self.masks[span]
        claimed = self.versions[span][mask] == version
        return claimed, self.behaviour[span][mask][claimed]


def _distinct(versions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct versions >= 0, count of each): most samples and groups hold one (np.unique costs ~10x more)."""
    if versions.size and versions[0] >= 0 and (versions == versions[0]).all():
        return versions[:1], np.array([versions.size])
    return np.unique(versions[versions >= 0], return_counts=True)


def step_facts(step: data.StepBatch) -> StepFacts:
    members = group_members(step)
    lens = [s.loss_mask.numel() for s in step.samples]
    starts = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64)
    if step.samples:
        masks = torch.cat([s.loss_mask for s in step.samples]).numpy()
        versions = torch.cat([s.versions if s.versions is not None else torch.full((n,), -1, dtype=torch.int64)
                              for s, n in zip(step.samples, lens, strict=True)]).numpy()
        behaviour = torch.cat([s.behaviour_logp for s in step.samples]).numpy()
    else:
        masks, versions = np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
        behaviour = np.zeros(0, dtype=np.float32)
    counts = np.concatenate([[0], np.cumsum(masks, dtype=np.int64)])
    num_trained = (counts[starts[1:]] - counts[starts[:-1]]).tolist()
    found = []
    for group in members:  # a group's samples are contiguous
        span = versions[starts[group[0]]:starts[group[-1] + 1]] if group else versions[:0]
        found.append(_distinct(span)[0].tolist())
    return StepFacts(members=members, num_trained=num_trained, group_versions=found, versions=versions,
                     masks=masks, behaviour=behaviour, starts=starts)


def check_evidence(versions: Sequence[int], served: Sequence[ServedAdapter], worker: str,
                   history: AdapterHistory, lora_ids: LoraIds) -> PolicyMismatch | None:
    """The evidence rules of one group from ``worker`` (its process: id and session; the group's id filled in by
    the caller); every lora_id claim is recorded."""
    by_version = {s.version: s for s in served}
    reused = []
    for version in versions:
        entry = by_version.get(version)
        if entry is not None:
            earlier = lora_ids.claim(worker, entry.lora_id, version)
            if earlier is not None:
                reused.append((version, entry.lora_id, earlier))
    missing = [v for v in versions if v not in by_version]
    if missing:
        return PolicyMismatch(group_id="", reason="no_evidence", version=missing[0],
                              detail=f"no ServedAdapter for version(s) {missing[:8]} of its tokens")
    for version in versions:
        expected = history.sha256(version)
        if expected is not None and by_version[version].sha256 != expected:
            return PolicyMismatch(group_id="", reason="adapter_sha256", version=version,
                                  detail=f"served sha256 {by_version[version].sha256[:16]!r}, published "
                                  f"{expected[:16]!r} (first 16 hex digits)")
    if reused:
        version, lora_id, earlier = reused[0]
        return PolicyMismatch(group_id="", reason="lora_id_reused", version=version,
                              detail=f"lora_id {lora_id} named version {earlier} earlier in this worker")
    return None

