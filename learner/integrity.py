"""The learner's policy check: before a batch's optimizer step, every group's evidence is checked and samples the
learner chose are scored under the exact adapter version each token claims; a group that fails is not trained.
Why this check and these tolerances: :mod:`loraflow.common.integrity`.

    every rank, in loraflow.learner.step.checked_train_step, on the decoded step batch (loraflow.learner.data.decode_step_batch):
    IntegrityCheck.run(step, defer_version=free_version)
      evidence   per group: a ServedAdapter for every version in its tokens (else no_evidence); its sha256 is the
                 one this learner published for that version while the history holds it (adapter_sha256; rank 0
                 alone publishes, so only rank 0 knows the hashes); its int lora_id named no other version earlier
                 from the same worker process (lora_id_reused, :class:`LoraIds`)
      choose     integrity.samples_per_group samples per group, ranked by blake2b(seed, group_id, k): the seed is
                 drawn by rank 0 at start-up and broadcast, so every rank picks the same ones and no worker can know
                 which (samples with trained tokens first)
      re-score   on an audited step every group's, else those of groups from workers on probation
                 (:class:`loraflow.learner.trust.Trust`), and then every group's too (the forward runs anyway; the
                 others' tokens are counted unaudited): the chosen samples'
                 trained tokens of every claimed version u the history holds, except the
                 one the parameters hold (free_version), all versions together: one row per (sample, version),
                 spread over the ranks by length and packed in learner.micro_batch_tokens micro-batches, a
                 micro-batch's rows sorted by version; one no-grad forward each in which every LoRA module adds
                 each block of rows' own version's delta from the history's tensors (:meth:`AdapterHistory.scoring`:
                 the parameters are never written), a row longer than the budget one forward per segment
                 (:meth:`loraflow.learner.segments.SplitRow.reference_pass`: each segment reads the earlier ones' keys and
                 values); every rank runs as many forwards, each is an FSDP2 collective; log-probs of the trained
                 tokens at worker.temperature (:meth:`loraflow.learner.model.Policy.trained_logprobs`, the numbers of
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

The history (:class:`AdapterHistory`) holds the LoRA tensors (whole, gathered from the ranks' shards when
recorded: a few MB a version) of the last ``run.max_staleness + 1`` versions, recorded at each publish, and v0
(the zero-B start) on a fresh start; staler tokens never reach the check (:func:`loraflow.learner.train.mask_stale_tokens` gives them loss mask 0 first, and a group
with no token within the bound is skipped as ``stale``). A version it does not hold can only be one from
before a learner restart that its checkpoint does not cover (the resumed learner holds the checkpoint's weights
under its version and the version it republishes them as): its tokens are counted ``unverifiable`` and pass, the
evidence is still checked.

Why one forward for all versions, and no swap: on a small model a forward costs about the same whatever its
rows (Python per layer and module, FSDP2's per-parameter unshard), so a step's re-scoring costs its number of
forwards; LoRA's delta is two small matmuls per module, so each row can take its own version's tensors in one
forward, where swapping versions in and out of the parameters costs a forward per version and two copies of
every LoRA tensor. (Measured, where it goes and what is left: BENCHMARKS.md "Policy integrity".)

No group can make the check raise: what it reads was validated when rank 0 selected the batch (lengths, token
ids, versions within the group's range, finite log-probs: an ``invalid`` group never gets here), and a group's
evidence is only compared, never trusted to index anything. Every rank runs the same code on the same data, so
a genuine bug would fail all of them alike rather than leave one waiting in a collective.

``lora_id_reused`` keys on the worker process: ``RolloutGroup.worker_id`` and ``worker_session``, which the broker
sets in every Batch from the Hello session of the process that submitted the group (a worker restarted under the
same ``worker.id`` numbers its loads from 1 again, and is a new process, not a reuse).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from loraflow.common import integrity
from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.protocol import PolicyMismatch, ServedAdapter
from loraflow.learner import data, segments
from loraflow.learner.model import Policy
from loraflow.learner.parallel import Parallel
from loraflow.learner.trust import Trust

log = get_logger("learner.integrity")

#: lora ids remembered per worker, and workers remembered (least recently seen forgotten first)
IDS_PER_WORKER = 64
MAX_WORKERS = 4096
#: a reported |diff| is capped here (an infinite one still fails; the wire and the JSON log want finite numbers)
MAX_REPORTED_DIFF = 1e9
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- the adapter history ---------------------------------------------------------------------------------------


def _whole(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Collective (parameters sharded over several ranks): each parameter's whole tensor, detached (on one rank the
    parameter's own storage: copy it before it changes). FSDP2's
    shards (``Shard(0)`` of a 1-D mesh: rank r holds rows ``[r c, (r + 1) c)``, c = ceil(rows / R), a short or
    empty last shard) travel in one all_gather of one flat buffer a rank, not one collective per tensor."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return [p.detach() for p in params]
    mesh = sharded[0].device_mesh
    world = mesh.size()
    if world == 1:
        return [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in params]
    if len(sharded) != len(params) or any(p.device_mesh != mesh or tuple(p.placements) != (Shard(0),)
                                          for p in sharded):
        return [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in params]
    chunks = [-(-p.shape[0] // world) for p in params]                       # rows of a full shard
    sizes = [c * p[0].numel() for c, p in zip(chunks, params, strict=True)]  # elements of a padded shard
    flat = torch.zeros(sum(sizes), dtype=params[0].dtype, device=params[0].to_local().device)
    for piece, p in zip(flat.split(sizes), params, strict=True):
        local = p.to_local().detach().reshape(-1)
        piece[:local.numel()] = local
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat, group=mesh.get_group())
    pieces = list(zip(*(g.split(sizes) for g in gathered), strict=True))   # per parameter: every rank's piece
    return [torch.cat([r.view(c, *p.shape[1:]) for r in ranks])[:p.shape[0]]
            for ranks, c, p in zip(pieces, chunks, params, strict=True)]


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    """(name, module) of every LoRA layer, each a plain peft ``lora.Linear`` of one adapter (what
    :meth:`AdapterHistory.scoring` computes); ValueError for any other kind (DoRA, a LoRA bias, merged weights,
    another layer type), which the learner never builds (:func:`loraflow.learner.model.lora_config_for`)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = list(module.lora_A.keys())
        plain = (isinstance(module, LoraLinear) and len(adapters) == 1 and not module.merged
                 and not module.use_dora.get(adapters[0], False)
                 and not getattr(module, "lora_bias", {}).get(adapters[0], False)
                 and adapters[0] not in getattr(module, "lora_variant", {}))
        if not plain:
            raise ValueError(f"{name}: the policy check re-scores plain LoRA linear layers of one adapter only, "
                             f"not a {type(module).__name__} with adapters {adapters}")
        found.append((name, module))
    return found


@dataclass(slots=True, kw_only=True)
class HeldVersion:
    weights: list[tuple[torch.Tensor, torch.Tensor]]  # per LoRA module: A [r, in], (scaling * B)^T [r, out] (a
                                                      # transposed view), whole tensors
    sha256: str | None                                # as published (v0: ""); None where unknown (ranks but 0)


class AdapterHistory:
    """The LoRA tensors of the newest ``keep`` versions, and the scoring forward that applies them.

    Each version is held whole (gathered from the ranks' shards when recorded) in the dtype the forward computes
    in (FSDP2 gathers the LoRA parameters in the compute dtype too), as each module's ``A`` and ``scaling * B``
    transposed: a LoRA delta is then ``(x A^T) (sB)^T``, one matmul and one ``addmm_``. Under :meth:`scoring`
    every LoRA module computes ``base(x) + delta`` with a version's tensors per block of rows instead of its
    parameters: the parameters are never written (nothing to swap in and out), and one forward scores the rows
    of several versions together."""

    def __init__(self, model: nn.Module, *, keep: int, dtype: torch.dtype) -> None:
        self._modules = [module for _, module in lora_modules(model)]
        self._keep = max(1, keep)
        self._dtype = dtype
        self._held: collections.OrderedDict[int, HeldVersion] = collections.OrderedDict()
        self._blocks: list[tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._rows = 0  # rows of the forward those blocks are for

    def record(self, version: int, sha256: str | None) -> None:
        """Collective (under several ranks): the parameters as they are now are ``version`` (published with
        ``sha256``); the oldest is forgotten."""
        adapters = [next(iter(module.lora_A.keys())) for module in self._modules]
        with torch.no_grad():
            whole = _whole([t for module, adapter in zip(self._modules, adapters, strict=True)
                            for t in (module.lora_A[adapter].weight, module.lora_B[adapter].weight)])
        weights = [(a.to(self._dtype, copy=True), (b * module.scaling[adapter]).to(self._dtype).t())
                   for module, adapter, a, b in zip(self._modules, adapters, whole[0::2], whole[1::2], strict=True)]
        self._held[version] = HeldVersion(weights=weights, sha256=sha256)
        self._held.move_to_end(version)
        while len(self._held) > self._keep:
            self._held.popitem(last=False)

    def holds(self, version: int) -> bool:
        return version in self._held

    def sha256(self, version: int) -> str | None:
        """What this learner published for ``version``; None when not held or not known on this rank."""
        held = self._held.get(version)
        return held.sha256 if held is not None else None

    @property
    def versions(self) -> list[int]:
        return list(self._held)

    @contextlib.contextmanager
    def scoring(self) -> Iterator[Callable[[Sequence[tuple[int, int, int]]], None]]:
        """For the duration every LoRA module applies held versions instead of its parameters (no dropout, no
        gradient); yields ``use(blocks)``: the next forwards' rows ``start:end`` under ``version``, for each
        (start, end, version) (rows in no block get the base alone)."""
        def use(blocks: Sequence[tuple[int, int, int]]) -> None:
            self._blocks = [(start, end, self._held[version].weights) for start, end, version in blocks]
            self._rows = blocks[-1][1] if blocks else 0

        if any("forward" in vars(m) for m in self._modules):
            raise RuntimeError("a LoRA module's forward is already replaced: AdapterHistory.scoring does not nest")
        for k, module in enumerate(self._modules):
            module.forward = functools.partial(self._forward, k, module.base_layer)
        try:
            with torch.no_grad():
                yield use
        finally:
            for module in self._modules:
                del module.forward
            self._blocks = []

    def _forward(self, k: int, base_layer: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """LoRA module ``k`` under :meth:`scoring`: x [B, L, in] -> base(x) + each block's delta [B, L, out]."""
        result = base_layer(x, *args, **kwargs)
        if len(self._blocks) > 1 and x.shape[0] != self._rows:
            raise ValueError(f"a LoRA layer's input {tuple(x.shape)} is not the batch's {self._rows} rows: rows "
                             "of several versions cannot be re-scored in one forward of this model")
        for start, end, weights in self._blocks:
            a, bt = weights[k]
            whole = len(self._blocks) == 1
            rows, out = (x, result) if whole else (x[start:end], result[start:end])
            hidden = torch.nn.functional.linear(rows.to(a.dtype), a)                           # [b, L, r]
            out.view(-1, out.shape[-1]).addmm_(hidden.view(-1, hidden.shape[-1]), bt)
        return result


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (no LoRA dropout: engines sample without it), each mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


# -- evidence --------------------------------------------------------------------------------------------------


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


# -- the check -------------------------------------------------------------------------------------------------


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


@dataclass(slots=True, kw_only=True)
class Verdict:
    """What the check decided about a step batch (identical on every rank, ``mismatches`` complete on rank 0)."""

    keep: list[int] = field(default_factory=list)                  # group indices to train, in order
    mismatches: list[PolicyMismatch] = field(default_factory=list)  # one per failed group, batch order
    seconds: float = 0.0
    num_checked_tokens: int = 0
    num_unverifiable_tokens: int = 0  # tokens of chosen samples whose version the history no longer holds
    max_passing_diff: float = 0.0  # the largest |behaviour - recomputed| of a sample that passed in a group kept:
                                   # the engine's agreement with the learner, what the tolerance must cover
    num_free_tokens: int = 0  # checked tokens whose log-probs came from the training forward (no extra forward)
    free_seconds: float = 0.0  # the part of ``seconds`` those took (their comparison, and a redo)
    num_forwards: int = 0     # re-scoring forwards run on this rank (one per micro-batch of all versions' rows)
    redone: bool = False      # forward/backward ran again without a group the training forward failed
    audited: bool = False     # an audited step: every worker's older versions re-scored (loraflow.learner.trust)
    compared: set[str] = field(default_factory=set)  # ids of the groups whose samples were compared (any path)
    num_unaudited_tokens: int = 0  # chosen samples' tokens of older versions from trusted workers, not re-scored


class IntegrityCheck:
    """The check of one learner process (every rank holds one; see the module docstring)."""

    def __init__(self, config: Config, policy: Policy, parallel: Parallel) -> None:
        self.config = config.integrity
        self.enabled = config.integrity.check
        self.policy = policy
        self.parallel = parallel
        self.temperature = config.worker.temperature
        self.budget_tokens = config.learner.micro_batch_tokens
        self.learner_dtype = _DTYPE_NAMES.get(policy.compute_dtype, str(policy.compute_dtype))
        self.history = AdapterHistory(policy.model, keep=config.run.max_staleness + 1, dtype=policy.compute_dtype)
        self.lora_ids = LoraIds()
        self.seed = parallel.broadcast_int(secrets.randbits(62))  # collective: every rank builds one at start-up
        self.trust = Trust(probation_groups=config.integrity.probation_groups,
                           audit_fraction=config.integrity.audit_fraction, seed=self.seed)
        self.current_version: int | None = None  # the version the parameters hold (None once a step changed them)
        self.exact_training_forward = not stochastic_modules(policy.model)  # modes are set once, at build time
        self.num_forwards = 0  # re-scoring forwards this rank ran (the free path runs none)
        self.num_redone_steps = 0  # steps whose forward/backward ran again without a group the free path failed
        self._chosen: dict[str, list[int]] = {}  # group id -> positions of its chosen samples (this step's)
        self._facts: tuple[data.StepBatch, StepFacts] | None = None  # of the batch run() saw last

    def record(self, version: int, sha256: str | None) -> None:
        """Collective: the parameters now hold ``version`` (call on every rank after each publish; its time, ~0.5 ms
        on the tiny model, counts in the learner's publish time, not in a verdict's)."""
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
        return self.current_version if self.enabled and self.exact_training_forward else None

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
        forwards = self.num_forwards
        verdict = self.judge(step, evidence, pairs, self._rescore(step, pairs))
        verdict.num_unverifiable_tokens = unverifiable
        verdict.num_unaudited_tokens = unaudited
        verdict.audited = audited
        verdict.num_forwards = self.num_forwards - forwards
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
        """Collective: [P, 4] float64 (num_checked, num_off, max |diff|, mean |diff|) of each pair, on every rank.
        The rows of every version together, packed in micro-batches; a micro-batch's rows sorted by version, each
        version's block scored under its tensors (:meth:`AdapterHistory.scoring`)."""
        out = torch.zeros(len(pairs), 4, dtype=torch.float64)
        if not pairs:  # every rank has the same pairs: none anywhere
            return out
        rows = [_restricted(step.samples[i], version) for i, version in pairs]
        modes = contextlib.nullcontext() if self.exact_training_forward else eval_mode(self.policy.model)
        with modes, self.history.scoring() as use:
            for micro in self._micro_batches([r.input_len for r in rows]):
                ks = sorted(micro, key=lambda k: pairs[k][1])
                use(_blocks([pairs[k][1] for k in ks]))
                self._score_micro(step, ks, [rows[k] for k in ks], [pairs[k][1] for k in ks], out)
        self.reduce(out, "sum")
        return out

    def _num_forwards(self, input_lens: Sequence[int], micro: Sequence[int]) -> int:
        """Forwards of one micro-batch: one, or one per segment of a single row longer than the budget."""
        if len(micro) != 1:
            return 1
        return len(segments.segment_bounds(input_lens[micro[0]], self.budget_tokens)) - 1

    def _micro_batches(self, input_lens: list[int]) -> list[list[int]]:
        """This rank's micro-batches (row indices) of these rows: spread over the ranks by length, packed by the
        token budget; empty ones pad the ranks with fewer forwards (each forward is a collective, and a long row
        runs one per segment), so every rank runs as many."""
        plans = [[[mine[j] for j in micro] for micro in data.plan_micro_batches([input_lens[i] for i in mine],
                                                                              self.budget_tokens)]
                 for mine in data.assign_to_ranks(input_lens, self.parallel.world_size)]
        forwards = [sum(self._num_forwards(input_lens, micro) for micro in plan) for plan in plans]
        mine = plans[self.parallel.rank]
        return mine + [[] for _ in range(max(forwards) - forwards[self.parallel.rank])]

    def _score_micro(self, step: data.StepBatch, ks: list[int], rows: list[data.Sample], versions: list[int],
                     out: torch.Tensor) -> None:
        """The no-grad forward(s) of these rows (pairs ``ks``, of ``versions``) under the scoring history; each
        row's comparison into ``out``."""
        mb = data.collate(rows, [0.0] * len(rows)).to(self.parallel.device)
        bounds = segments.segment_bounds(mb.input_ids.shape[1], self.budget_tokens) if len(rows) == 1 else (0, 1)
        if len(bounds) > 2:
            logp = self._score_segments(mb, bounds)
        else:
            self.num_forwards += 1
            logp, _ = self.policy.trained_logprobs(mb.input_ids, mb.select, mb.targets[mb.select],
                                                   self.temperature, with_entropy=False)
        if not rows:
            return
        tolerances = [self._tolerance(step, row.group, version) for row, version in zip(rows, versions, strict=True)]
        out[ks] = torch.from_numpy(integrity.compare_rows(mb.behaviour_logp.cpu().numpy(), logp.float().cpu().numpy(),
                                                          [r.num_trained for r in rows], tolerances))

    def _score_segments(self, mb: data.MicroBatch, bounds: tuple[int, ...]) -> torch.Tensor:
        """[T] log-probs of a single row longer than the budget, one forward per segment (no gradient)."""
        row = segments.SplitRow(input_ids=mb.input_ids, select=mb.select, targets=mb.targets, bounds=bounds,
                                num_layers=self.policy.model.config.num_hidden_layers)

        def forward(input_ids, select, targets, past, with_entropy):
            return self.policy.trained_logprobs(input_ids, select, targets, self.temperature,
                                                with_entropy=with_entropy, past=past)

        for i in range(row.num_segments):
            self.num_forwards += 1
            row.reference_pass(forward, i)
        return torch.cat(row.ref_logp)


def _blocks(versions: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, version) of each run of equal versions in ``versions`` (rows sorted by version)."""
    blocks: list[tuple[int, int, int]] = []
    for row, version in enumerate(versions):
        if blocks and blocks[-1][2] == version:
            blocks[-1] = (blocks[-1][0], row + 1, version)
        else:
            blocks.append((row, row + 1, version))
    return blocks


def _restricted(sample: data.Sample, version: int) -> data.Sample:
    """The sample with only its trained tokens of ``version`` selected."""
    assert sample.versions is not None
    return data.Sample(group=sample.group, tokens=sample.tokens, prompt_len=sample.prompt_len,
                       behaviour_logp=sample.behaviour_logp, loss_mask=sample.loss_mask & (sample.versions == version),
                       versions=sample.versions)


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


def merged(step: data.StepBatch, first: Verdict, survivors: Verdict) -> Verdict:
    """One verdict on ``step`` from ``first`` (on ``step``) and ``survivors`` (on the groups ``first`` kept)."""
    order = {group_id: g for g, group_id in enumerate(step.group_ids)}
    return Verdict(keep=[first.keep[k] for k in survivors.keep],
                   mismatches=sorted(first.mismatches + survivors.mismatches, key=lambda m: order[m.group_id]),
                   seconds=first.seconds + survivors.seconds,
                   num_checked_tokens=first.num_checked_tokens + survivors.num_checked_tokens,
                   num_unverifiable_tokens=first.num_unverifiable_tokens + survivors.num_unverifiable_tokens,
                   max_passing_diff=max(first.max_passing_diff, survivors.max_passing_diff),
                   num_free_tokens=first.num_free_tokens + survivors.num_free_tokens,
                   free_seconds=first.free_seconds + survivors.free_seconds,
                   num_forwards=first.num_forwards + survivors.num_forwards, audited=first.audited,
                   compared=first.compared | survivors.compared,
                   num_unaudited_tokens=first.num_unaudited_tokens + survivors.num_unaudited_tokens)


def stochastic_modules(model: nn.Module) -> list[str]:
    """Modules in train mode whose forward is random (dropout with p > 0, attention dropout): then the training
    forward is not what an engine computes, and the current version is re-scored like the others."""
    return [name for name, m in model.named_modules() if m.training and (
        (isinstance(m, nn.Dropout) and m.p > 0) or float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0)]


def log_mismatches(verdict: Verdict) -> None:
    """One ``policy_mismatch`` warning per failed group, with its evidence (rank 0)."""
    for m in verdict.mismatches:
        log.warning("policy_mismatch", group_id=m.group_id, worker_id=m.worker_id, reason=m.reason,
                    version=m.version, num_checked=m.num_checked, num_off=m.num_off,
                    max_abs_diff=round(m.max_abs_diff, 6), mean_abs_diff=round(m.mean_abs_diff, 6), detail=m.detail)
