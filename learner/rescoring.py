"""Re-scoring for the policy check (:mod:`loraflow.learner.integrity`): the LoRA tensors of the adapter versions
the learner published, and the no-grad forwards that score (sample, version) rows under them.

    AdapterHistory   the last ``run.max_staleness + 1`` versions, recorded at each publish (and v0, the zero-B
                     start, on a fresh start): per LoRA module A and (scaling * B)^T, whole (gathered from the
                     ranks' shards when recorded: a few MB a version)
      scoring()      while it lasts, every LoRA module computes base(x) + delta with each block of rows' own
                     version's tensors instead of its parameters: the parameters are never written
    Rescorer.score   the rows of every version together: spread over the ranks by length, packed in
                     learner.micro_batch_tokens micro-batches, a micro-batch's rows sorted by version; one forward
                     a micro-batch, a row longer than the budget one forward per segment
                     (:meth:`loraflow.learner.segments.SplitRow.reference_pass`); every rank runs as many forwards
                     (each is an FSDP2 collective); each row's log-probs of its trained tokens at
                     worker.temperature compared with the behaviour ones (:func:`loraflow.common.integrity.compare_rows`)

Why one forward for all versions, and no swap: on a small model a forward costs about the same whatever its
rows (Python per layer and module, FSDP2's per-parameter unshard), so a step's re-scoring costs its number of
forwards; LoRA's delta is two small matmuls per module, so each row can take its own version's tensors in one
forward, where swapping versions in and out of the parameters costs a forward per version and two copies of
every LoRA tensor (BENCHMARKS.md "Policy integrity").
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from loraflow.common import integrity
from loraflow.learner import data, segments
from loraflow.learner.model import Policy
from loraflow.learner.parallel import Parallel

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


def stochastic_modules(model: nn.Module) -> list[str]:
    """Modules in train mode whose forward is random (dropout with p > 0, attention dropout): then the training
    forward is not what an engine computes, and the current version is re-scored like the others."""
    return [name for name, m in model.named_modules() if m.training and (
        (isinstance(m, nn.Dropout) and m.p > 0) or float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0)]


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


# -- the scoring forwards --------------------------------------------------------------------------------------


class Rescorer:
    """The re-scoring forwards of one learner process (every rank holds one): (sample, version) rows scored under
    the history's versions, as the module docstring describes."""

    def __init__(self, policy: Policy, parallel: Parallel, history: AdapterHistory, *, temperature: float,
                 budget_tokens: int) -> None:
        self.policy = policy
        self.parallel = parallel
        self.history = history
        self.temperature = temperature
        self.budget_tokens = budget_tokens
        self.exact_training_forward = not stochastic_modules(policy.model)  # modes are set once, at build time
        self.num_forwards = 0  # re-scoring forwards this rank ran

    def score(self, step: data.StepBatch, pairs: list[tuple[int, int]], tolerances: Sequence[float]) -> torch.Tensor:
        """Collective (each forward): [P, 4] float64 (num_checked, num_off, max |diff|, mean |diff|) of the pairs
        this rank scored, zeros for the others' (sum over the ranks for every pair's); ``tolerances``: each pair's.
        The rows of every version together, packed in micro-batches; a micro-batch's rows sorted by version, each
        version's block scored under its tensors (:meth:`AdapterHistory.scoring`)."""
        out = torch.zeros(len(pairs), 4, dtype=torch.float64)
        if not pairs:
            return out
        rows = [_restricted(step.samples[i], version) for i, version in pairs]
        modes = contextlib.nullcontext() if self.exact_training_forward else eval_mode(self.policy.model)
        with modes, self.history.scoring() as use:
            for micro in self._micro_batches([r.input_len for r in rows]):
                ks = sorted(micro, key=lambda k: pairs[k][1])
                use(_blocks([pairs[k][1] for k in ks]))
                self._score_micro(ks, [rows[k] for k in ks], [tolerances[k] for k in ks], out)
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

    def _score_micro(self, ks: list[int], rows: list[data.Sample], tolerances: list[float],
                     out: torch.Tensor) -> None:
        """The no-grad forward(s) of these rows (pairs ``ks``) under the scoring history; each row's comparison
        (at its tolerance) into ``out``."""
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
