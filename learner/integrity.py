"""The learner's policy check: before a batch's optimizer step, every group's evidence is checked and samples the
learner chose are scored under the exact adapter version each token claims; a group that fails is not trained.
Why this check and these tolerances: :mod:`loraflow.common.integrity`. Its parts: what a step batch shows and the
evidence rules (:mod:`loraflow.learner.evidence`), the held versions and the re-scoring forwards
(:mod:`loraflow.learner.rescoring`), the verdict (:mod:`loraflow.learner.verdicts`), who is on probation
(:mod:`loraflow.learner.trust`). This module owns the choice of what to re-score and the judgement.

    every rank, in loraflow.learner.step.checked_train_step, on the decoded step batch (loraflow.learner.data.decode_step_batch):
    IntegrityCheck.run(step, defer_version=free_version)
      evidence   per group (:func:`loraflow.learner.evidence.check_evidence`): no_evidence, adapter_sha256,
                 lora_id_reused
      choose     integrity.samples_per_group samples per group, ranked by blake2b(seed, group_id, k): the seed is
                 drawn by rank 0 at start-up and broadcast, so every rank picks the same ones and no worker can know
                 which (samples with trained tokens first)
      re-score   on an audited step every group's, else those of groups from workers on probation
                 (:class:`loraflow.learner.trust.Trust`), and then every group's too (the forward runs anyway; the
                 others' tokens are counted unaudited): the chosen samples'
                 trained tokens of every claimed version u the history holds, except the
                 one the parameters hold (free_version), all versions together: one row per (sample, version),
                 in no-grad forwards under the history's tensors (:class:`loraflow.learner.rescoring.Rescorer`:
                 the parameters are never written); log-probs of the trained tokens at worker.temperature
                 (:meth:`loraflow.learner.model.Policy.trained_logprobs`, the numbers of
                 loraflow.common.logprobs.token_logprobs) vs the behaviour ones (loraflow.common.integrity.compare_rows, tolerance
                 by the served and the learner's dtypes); each rank's (sample, version) results summed over the ranks
      agree      all_reduce MAX of the per-group fail flags: every rank drops the same groups
    TrainedCheck(surviving groups, free_version)   the free path: no forward of its own
      observe    the training forward's log-probs of each micro-batch (detached): those of the chosen samples'
                 tokens of free_version, the same numbers a re-scoring forward computes (eval mode changes nothing
                 when no module is stochastic; with LoRA dropout free_version is None and every version is
                 re-scored)
      finish     compared, summed over the ranks, agreed as above, after backward and before optimizer.step();
                 a failed group: checked_train_step drops it and runs forward/backward again without it
    -> Verdict (merged): the groups to keep, one PolicyMismatch per failed group (with rank 0's evidence),
       seconds, tokens (free ones too, and the unaudited ones), re-scoring forwards, whether the step was audited
    IntegrityCheck.settle(step, verdict)   after the optimizer step: each compared group that was kept counts a
                 pass for its worker process, each failed one puts it back on probation (alike on every rank)

free_version is the version :meth:`IntegrityCheck.record` last saw the parameters hold, forgotten at the
optimizer's next step (:meth:`IntegrityCheck.watch`): with learner.publish_every > 1 a step between two
publishes holds no version, and every version is re-scored.

The history (:class:`loraflow.learner.rescoring.AdapterHistory`) holds the last ``run.max_staleness + 1``
versions; staler tokens never reach the check (:func:`loraflow.learner.data.mask_stale_tokens` gives them loss
mask 0 first, and a group with no token within the bound is skipped as ``stale``). A version it does not hold can
only be one from before a learner restart that its checkpoint does not cover (the resumed learner holds the
checkpoint's weights under its version and the version it republishes them as): its tokens are counted
``unverifiable`` and pass, the evidence is still checked.

No group can make the check raise: what it reads was validated when rank 0 selected the batch (lengths, token
ids, versions within the group's range, finite log-probs: an ``invalid`` group never gets here), and a group's
evidence is only compared, never trusted to index anything. Every rank runs the same code on the same data, so
a genuine bug would fail all of them alike rather than leave one waiting in a collective.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence

import numpy as np
import torch

from loraflow.common import integrity
from loraflow.common.config import Config
from loraflow.common.protocol import PolicyMismatch, ServedAdapter
from loraflow.learner import data
from loraflow.learner.evidence import (
    LoraIds,
    StepFacts,
    check_evidence,
    group_members,
    process_of,
    step_facts,
)
from loraflow.learner.model import Policy
from loraflow.learner.parallel import Parallel
from loraflow.learner.rescoring import AdapterHistory, Rescorer
from loraflow.learner.trust import Trust
from loraflow.learner.verdicts import MAX_REPORTED_DIFF, Verdict

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def chosen_samples(step: data.StepBatch, group: int, members: Sequence[int], seed: int, count: int,
                   num_trained: Sequence[int] | None = None) -> list[int]:
    """Indices (into ``step.samples``) of the group's samples (``members``) to re-score: those with trained tokens
    first, then by a keyed hash of (seed, group id, position in the group). ``num_trained``: of every sample of
    ``step``, when known."""
    group_id = step.group_ids[group]

    def key(k: int) -> tuple[bool, bytes]:
        digest = hashlib.blake2b(f"{seed}:{group_id}:{k}".encode(), digest_size=8).digest()
        trained = num_trained[members[k]] if num_trained is not None else step.samples[members[k]].num_trained
        return trained == 0, digest

    return sorted(members[k] for k in sorted(range(len(members)), key=key)[:count])


class IntegrityCheck:
    """The check of one learner process (every rank holds one; see the module docstring)."""

    def __init__(self, config: Config, policy: Policy, parallel: Parallel) -> None:
        self.config = config.integrity
        self.enabled = config.integrity.check
        self.policy = policy
        self.parallel = parallel
        self.temperature = config.worker.temperature
        self.learner_dtype = _DTYPE_NAMES.get(policy.compute_dtype, str(policy.compute_dtype))
        self.history = AdapterHistory(policy.model, keep=config.run.max_staleness + 1, dtype=policy.compute_dtype)
        self.rescorer = Rescorer(policy, parallel, self.history, temperature=config.worker.temperature,
                                 budget_tokens=config.learner.micro_batch_tokens)
        self.lora_ids = LoraIds()
        self.seed = parallel.broadcast_int(secrets.randbits(62))  # collective: every rank builds one at start-up
        self.trust = Trust(probation_groups=config.integrity.probation_groups,
                           audit_fraction=config.integrity.audit_fraction, seed=self.seed)
        self.current_version: int | None = None  # the version the parameters hold (None once a step changed them)
        self.num_redone_steps = 0  # steps whose forward/backward ran again without a group the free path failed
        self._chosen: dict[str, list[int]] = {}  # group id -> positions of its chosen samples (this step's)
        self._facts: tuple[data.StepBatch, StepFacts] | None = None  # of the batch run() saw last

    def record(self, version: int, sha256: str | None) -> None:
        """Collective: the parameters now hold ``version`` (call on every rank after each publish; its time counts
        in the learner's publish time, not in a verdict's)."""
        if self.enabled:
            self.history.record(version, sha256)
            self.current_version = version

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget which version the parameters hold at every step of ``optimizer`` (they no longer hold any)."""
        optimizer.register_step_post_hook(lambda *_: self._parameters_changed())

    def _parameters_changed(self) -> None:
        self.current_version = None

    @property
    def free_version(self) -> int | None:
        """The version whose tokens the training forward itself checks (the one the parameters hold, when the
        training forward computes what an engine does: no dropout in train mode); None: every version re-scored."""
        return self.current_version if self.enabled and self.rescorer.exact_training_forward else None

    def run(self, step: data.StepBatch, *, defer_version: int | None = None) -> Verdict:
        """Collective: the verdict on every group of ``step``: its evidence, and its chosen samples re-scored under
        each version they claim, except ``defer_version``'s tokens, which :class:`TrainedCheck` checks from the
        training forward (build it on the surviving groups)."""
        started = time.monotonic()
        if not self.enabled:
            return Verdict(keep=list(range(step.num_groups)))
        facts = self.facts(step, fresh=True)
        evidence = [self._evidence(step, g, facts.group_versions[g]) for g in range(step.num_groups)]
        pairs, unverifiable, unaudited, audited = self._pairs(step, facts, drawn=self.trust.audited(step.group_ids),
                                                               defer_version=defer_version)
        forwards = self.rescorer.num_forwards
        verdict = self.judge(step, evidence, pairs, self._rescore(step, pairs))
        verdict.num_unverifiable_tokens = unverifiable
        verdict.num_unaudited_tokens = unaudited
        verdict.audited = audited
        verdict.num_forwards = self.rescorer.num_forwards - forwards
        verdict.seconds = time.monotonic() - started
        return verdict

    def judge(self, step: data.StepBatch, evidence: Sequence[PolicyMismatch | None], pairs: list[tuple[int, int]],
              results: torch.Tensor) -> Verdict:
        """Collective: the verdict from each group's evidence failure (or None) and each (sample, version) pair's
        comparison (``results`` [P, 4], summed over the ranks); every rank drops the groups any rank failed."""
        members = group_members(step)
        failures: dict[int, PolicyMismatch] = {g: found for g, found in enumerate(evidence) if found is not None}
        passing_diff: dict[int, float] = {}  # group -> the largest difference of its samples that passed
        for (sample, version), row in zip(pairs, results.tolist(), strict=True):
            g = step.samples[sample].group
            num_checked, num_off, max_diff, mean_diff = int(row[0]), int(row[1]), row[2], row[3]
            noisy = integrity.noisy_tokens(self._engine_dtype(step, g, version), self.learner_dtype)
            if integrity.sample_passes(num_off, num_checked, self.config.max_off_fraction, noisy):
                passing_diff[g] = max(passing_diff.get(g, 0.0), max_diff if num_checked else 0.0)
                continue
            if g in failures:
                continue
            failures[g] = PolicyMismatch(
                group_id="", reason="logprobs", version=version, num_checked=num_checked, num_off=num_off,
                max_abs_diff=min(max_diff, MAX_REPORTED_DIFF), mean_abs_diff=min(mean_diff, MAX_REPORTED_DIFF),
                detail=f"sample {sample - members[g][0]}: {num_off} of {num_checked} tokens off by more "
                f"than {self._tolerance(step, g, version):g} nats at temperature {self.temperature:g}")
        flags = torch.tensor([int(g in failures) for g in range(step.num_groups)], dtype=torch.int32)
        self.reduce(flags, "max")  # rank 0 alone knows the published hashes: agree on its verdicts
        # over the groups kept only: a sample of a group failed by its evidence (a stale LoRA id serving a
        # neighbouring version, say) may pass the comparison, and is no measure of a healthy engine's agreement
        failed_groups = flags.tolist()
        max_passing_diff = max((d for g, d in passing_diff.items() if not failed_groups[g]), default=0.0)
        verdict = Verdict(num_checked_tokens=int(results[:, 0].sum()) if len(pairs) else 0,
                          max_passing_diff=min(max_passing_diff, MAX_REPORTED_DIFF),
                          compared={step.group_ids[step.samples[i].group] for i, _ in pairs})
        for g, failed in enumerate(failed_groups):
            if not failed:
                verdict.keep.append(g)
                continue
            found = failures.get(g) or PolicyMismatch(group_id="", reason="adapter_sha256",
                                                      detail="failed on another rank")
            found.group_id, found.worker_id = step.group_ids[g], step.worker_ids[g]
            verdict.mismatches.append(found)
        return verdict

    def reduce(self, tensor: torch.Tensor, op: str) -> None:
        """Collective (under several ranks): ``tensor`` summed or maxed over the ranks, in place. One rank: as it
        is (a gloo all_reduce of one process still costs ~0.5 ms, a share of a small step)."""
        if self.parallel.world_size > 1:
            (self.parallel.sum if op == "sum" else self.parallel.max)(tensor)

    def settle(self, step: data.StepBatch, verdict: Verdict) -> None:
        """After a step's verdict (alike on every rank): each group's worker process passed if the group was
        compared and kept, and is on probation again if the group failed (:class:`loraflow.learner.trust.Trust`)."""
        if not self.enabled:
            return
        failed = {m.group_id for m in verdict.mismatches}
        for g, group_id in enumerate(step.group_ids):
            if group_id in failed:
                self.trust.failed(process_of(step, g))
            elif group_id in verdict.compared:
                self.trust.passed(process_of(step, g))

    def _evidence(self, step: data.StepBatch, group: int, versions: list[int]) -> PolicyMismatch | None:
        return check_evidence(versions, step.served[group], process_of(step, group), self.history, self.lora_ids)

    def _served(self, step: data.StepBatch, group: int, version: int) -> ServedAdapter | None:
        return next((s for s in step.served[group] if s.version == version), None)

    def _engine_dtype(self, step: data.StepBatch, group: int, version: int) -> str:
        served = self._served(step, group, version)
        return served.dtype if served is not None else "float32"

    def _tolerance(self, step: data.StepBatch, group: int, version: int) -> float:
        return integrity.tolerance(self._engine_dtype(step, group, version), self.learner_dtype,
                                   self.config.token_tolerance)

    def facts(self, step: data.StepBatch, *, fresh: bool = False) -> StepFacts:
        """:func:`step_facts` of ``step``, kept for the free path's look at the same batch object."""
        if fresh or self._facts is None or self._facts[0] is not step:
            self._facts = (step, step_facts(step))
        return self._facts[1]

    def chosen(self, step: data.StepBatch, facts: StepFacts, group: int) -> list[int]:
        """:func:`chosen_samples` of a group, as positions in the group are remembered by group id until the next
        :meth:`run` (the free path asks again on the batch of the surviving groups)."""
        group_id = step.group_ids[group]
        members = facts.members[group]
        positions = self._chosen.get(group_id)
        if positions is None or any(k >= len(members) for k in positions):
            chosen = chosen_samples(step, group, members, self.seed, self.config.samples_per_group,
                                    facts.num_trained)
            positions = self._chosen[group_id] = [members.index(i) for i in chosen]
        return [members[k] for k in positions]

    def _pairs(self, step: data.StepBatch, facts: StepFacts, *, drawn: bool,
               defer_version: int | None) -> tuple[list[tuple[int, int]], int, int, bool]:
        """(sample, version) pairs to re-score, from what every rank knows alike: the chosen samples' versions
        other than ``defer_version`` (the training forward's) of every group on a step ``drawn`` for an audit,
        and of groups from workers on probation on the others, unless those need a forward anyway: then of every
        group (a forward costs about the same whatever its rows); the tokens of chosen samples whose version is
        not held (unverifiable), and of those left unaudited; whether every group's were re-scored."""
        candidates: list[tuple[int, int, int, bool]] = []  # (sample, version, tokens, re-scored whatever the step)
        unverifiable = 0
        self._chosen = {}
        for g in range(step.num_groups):
            exact = drawn or self.trust.on_probation(process_of(step, g))
            for i in self.chosen(step, facts, g):
                for version, count in zip(*(a.tolist() for a in facts.trained_versions(i)), strict=True):
                    if version == defer_version:
                        continue  # the training forward's
                    if not self.history.holds(version):
                        unverifiable += count
                    elif self._served(step, g, version) is not None:  # else failed as no_evidence already
                        candidates.append((i, version, count, exact))
        every = drawn or any(exact for *_, exact in candidates)
        pairs = [(i, version) for i, version, _, exact in candidates if every or exact]
        unaudited = sum(count for *_, count, exact in candidates if not (every or exact))
        return pairs, unverifiable, unaudited, every

    def _rescore(self, step: data.StepBatch, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """Collective: [P, 4] float64 (num_checked, num_off, max |diff|, mean |diff|) of each pair, on every rank
        (:meth:`loraflow.learner.rescoring.Rescorer.score`, summed over the ranks)."""
        tolerances = [self._tolerance(step, step.samples[i].group, version) for i, version in pairs]
        out = self.rescorer.score(step, pairs, tolerances)
        if pairs:  # every rank has the same pairs: none anywhere, nothing to sum
            self.reduce(out, "sum")
        return out


class TrainedCheck:
    """The chosen samples' tokens of the version the parameters hold, checked from the training forward's own
    log-probs (detached, at worker.temperature): no extra forward. Build it on the step batch that is trained
    (after :meth:`IntegrityCheck.run` dropped its failures), feed it every micro-batch's log-probs
    (:meth:`observe`), then :meth:`finish` (collective) before the optimizer step."""

    def __init__(self, check: IntegrityCheck, step: data.StepBatch, version: int) -> None:
        started = time.monotonic()
        self.check, self.step, self.version = check, step, version
        self.facts = facts = check.facts(step)
        self.pairs: list[tuple[int, int]] = []
        for g in range(step.num_groups):
            if check._served(step, g, version) is not None:  # else failed as no_evidence already
                for i in check.chosen(step, facts, g):
                    if version in facts.trained_versions(i)[0]:
                        self.pairs.append((i, version))
        self._watched = {i: k for k, (i, _) in enumerate(self.pairs)}
        self._seen: list[tuple[int, torch.Tensor]] = []  # (pair, its sample's trained log-probs), on the device
        self.seconds = time.monotonic() - started

    def observe(self, rows: Sequence[int], logp: torch.Tensor) -> None:
        """A micro-batch's rows (sample indices) and its trained tokens' log-probs [T] (row-major, as the loss)."""
        started = time.monotonic()
        if any(i in self._watched for i in rows):
            pieces = logp.detach().split([self.facts.num_trained[i] for i in rows])
            self._seen.extend((self._watched[i], piece) for i, piece in zip(rows, pieces, strict=True)
                              if i in self._watched)
        self.seconds += time.monotonic() - started

    def finish(self) -> Verdict:
        """Collective: the verdict on this step batch's groups from the observed log-probs (the evidence was
        judged by :meth:`IntegrityCheck.run`)."""
        started = time.monotonic()
        if not self.pairs:  # alike on every rank: nothing to agree on
            return Verdict(keep=list(range(self.step.num_groups)), seconds=self.seconds,
                           free_seconds=self.seconds)
        out = torch.zeros(len(self.pairs), 4, dtype=torch.float64)
        if self._seen:
            behaviour, claimed_rows, counts, tolerances = [], [], [], []
            for k, _ in self._seen:
                i = self.pairs[k][0]
                claimed, theirs = self.facts.claimed(i, self.version)
                claimed_rows.append(claimed)
                behaviour.append(theirs)
                counts.append(theirs.size)
                tolerances.append(self.check._tolerance(self.step, self.step.samples[i].group, self.version))
            recomputed = torch.cat([piece for _, piece in self._seen]).float().cpu().numpy()[np.concatenate(claimed_rows)]
            out[[k for k, _ in self._seen]] = torch.from_numpy(integrity.compare_rows(
                np.concatenate(behaviour), recomputed, counts, tolerances))
        self.check.reduce(out, "sum")
        verdict = self.check.judge(self.step, [None] * self.step.num_groups, self.pairs, out)
        verdict.num_free_tokens = verdict.num_checked_tokens
        verdict.seconds = verdict.free_seconds = self.seconds + time.monotonic() - started
        return verdict


