"""One optimizer step on a step batch: this rank's micro-batches through the loss, backward, clip, AdamW.

Every rank calls :func:`train_step` with the same :class:`loraflow.learner.data.StepBatch`; each trains its share of the
samples (``data.rank_micro_batches``), and FSDP2 reduce-scatters the LoRA gradients once, in the last
micro-batch's backward (:func:`sync_gradients`). Log-probs come from the trained positions only
(:meth:`loraflow.learner.model.Policy.trained_logprobs`: no ``[B, L, V]`` logits). Each trained token of the
batch weighs ``1 / N`` (N = trained tokens of the whole batch, known to every rank), and FSDP2 averages over
the R ranks, so each rank scales its loss by ``R / N``: the gradient is that of one process on the whole batch.
Statistics are summed over micro-batches and ranks, so every rank returns the same numbers. A row longer than
``micro_batch_tokens`` runs in segments (:class:`loraflow.learner.segments.SplitRow`: several passes), so the ranks'
passes are lined up before they run (:func:`loraflow.learner.segments.aligned`).

The learner loop calls :func:`checked_train_step`: the policy check (:mod:`loraflow.learner.integrity`) around the same
forward/backward (:func:`forward_backward`), whose log-probs check the tokens of the version the parameters
hold before :func:`optimizer_step`; a group failing there costs one more forward/backward without it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loraflow.common.config import Config, LearnerConfig
from loraflow.learner import data, integrity, segments, verdicts
from loraflow.learner.loss import SUM_STATS, LossConfig, group_advantages, token_loss, token_stats
from loraflow.learner.model import Policy
from loraflow.learner.parallel import Parallel


@dataclass(slots=True, kw_only=True)
class Computed:
    """What this rank's forward/backward passes of a step batch left for the optimizer step and the statistics."""

    advantages: torch.Tensor    # [N] f32
    sums: torch.Tensor          # [len(SUM_STATS)] f64, this rank's
    ratio_max: torch.Tensor     # [1] f64
    num_positions: torch.Tensor  # [1] f64


def forward_backward(policy: Policy, step: data.StepBatch, *, parallel: Parallel, config: Config,
                     loss_config: LossConfig, observe: Callable[[Sequence[int], torch.Tensor], None] | None = None
                     ) -> Computed:
    """This rank's micro-batches through the loss and backward: the gradients accumulate in the parameters
    (collective). ``observe(rows, logp)`` sees each micro-batch's sample indices and trained log-probs [T].

    The passes of all ranks are lined up (:func:`loraflow.learner.segments.aligned`): a micro-batch is one forward+backward
    (after the KL reference's no-grad forward when ``kl_beta > 0``), a row longer than the budget the passes of
    :class:`loraflow.learner.segments.SplitRow`; a rank with nothing of a kind to run at a step runs an empty pass."""
    learner = config.learner
    budget = learner.micro_batch_tokens
    with_reference = loss_config.kl_beta > 0
    advantages, _ = group_advantages(step.rewards, step.group_index, step.num_groups,
                                     scale_by_std=learner.scale_by_std)                      # [N]
    micro_batches = data.rank_micro_batches(step, advantages, rank=parallel.rank, world_size=parallel.world_size,
                                            budget_tokens=budget)
    kinds = data.rank_pass_kinds(step, world_size=parallel.world_size, budget_tokens=budget,
                                 with_reference=with_reference)
    out = Computed(advantages=advantages, sums=torch.zeros(len(SUM_STATS), dtype=torch.float64),
                   ratio_max=torch.zeros(1, dtype=torch.float64), num_positions=torch.zeros(1, dtype=torch.float64))
    passes = _Passes(policy=policy, out=out, temperature=config.worker.temperature, loss_config=loss_config,
                     scale=parallel.world_size / max(step.num_trained_tokens, 1), observe=observe)
    mine = [p for micro in micro_batches for p in passes.of(micro, micro.to(parallel.device))]
    assert [kind for kind, _ in mine] == kinds[parallel.rank]
    schedule = segments.aligned(kinds, parallel.rank)
    last_grad = max((i for i, (kind, _) in enumerate(schedule) if kind == segments.GRAD), default=-1)
    empty = data.collate([], []).to(parallel.device)
    for index, (kind, own) in enumerate(schedule):
        run = mine[own][1] if own is not None else functools.partial(passes.empty, empty, kind)
        if kind == segments.GRAD:
            with sync_gradients(policy.model, index == last_grad):
                run()
        else:
            run()
    return out


@dataclass(slots=True, kw_only=True)
class _Passes:
    """The passes of this rank's micro-batches, as (kind, function) in the order they run; each adds its
    statistics to ``out``."""

    policy: Policy
    out: Computed
    temperature: float
    loss_config: LossConfig
    scale: float           # R / N: each trained token weighs 1 / N, FSDP2 averages over R ranks
    observe: Callable[[Sequence[int], torch.Tensor], None] | None

    def forward(self, input_ids: torch.Tensor, select: torch.Tensor, targets: torch.Tensor, past: Any,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy.trained_logprobs(input_ids, select, targets, self.temperature, with_entropy=with_entropy,
                                            past=past)

    def loss(self, logp: torch.Tensor, entropy: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
             ref_logp: torch.Tensor | None) -> torch.Tensor:
        """The scaled loss of these trained tokens (a scalar to backpropagate); their statistics into ``out``."""
        terms = token_loss(logp, behaviour_logp, advantages, self.loss_config, ref_logp)
        sums, ratio_max = token_stats(terms, entropy)
        self.out.sums += sums.cpu()
        self.out.ratio_max = torch.maximum(self.out.ratio_max, ratio_max.cpu())
        return terms.loss.sum() * self.scale

    def of(self, micro: data.MicroBatch, mb: data.MicroBatch) -> list[tuple[str, Callable[[], None]]]:
        """``micro`` on the CPU, ``mb`` the same on the device."""
        self.out.num_positions += float(micro.num_positions)
        if mb.segments:
            return self._split(micro, mb)
        state: dict[str, torch.Tensor] = {}
        targets = mb.targets[mb.select]                                                      # [T]

        def reference() -> None:
            with torch.no_grad(), self.policy.reference():
                state["ref"], _ = self.forward(mb.input_ids, mb.select, targets, None, False)  # [T]

        def train() -> None:
            logp, entropy = self.forward(mb.input_ids, mb.select, targets, None, True)      # [T], [T]
            if self.observe is not None:
                self.observe(micro.rows, logp)
            self.loss(logp, entropy, mb.behaviour_logp, mb.advantages, state.pop("ref", None)).backward()

        return ([(segments.NO_GRAD, reference)] if self.loss_config.kl_beta > 0 else []) + [(segments.GRAD, train)]

    def _split(self, micro: data.MicroBatch, mb: data.MicroBatch) -> list[tuple[str, Callable[[], None]]]:
        row = segments.SplitRow(input_ids=mb.input_ids, select=mb.select, targets=mb.targets, bounds=mb.segments,
                                num_layers=self.policy.model.config.num_hidden_layers)
        n = row.num_segments

        def reference(i: int) -> None:
            with self.policy.reference():
                row.reference_pass(self.forward, i)

        def train(i: int) -> None:
            start, end = row.token_range(i)
            ref = torch.cat(row.ref_logp)[start:end] if row.ref_logp else None
            row.second_pass(self.forward, i, lambda logp, entropy: self.loss(
                logp, entropy, mb.behaviour_logp[start:end], mb.advantages[start:end], ref))
            if i == 0 and self.observe is not None:
                self.observe(micro.rows, row.trained_logp())

        out: list[tuple[str, Callable[[], None]]] = []
        if self.loss_config.kl_beta > 0:
            out += [(segments.NO_GRAD, functools.partial(reference, i)) for i in range(n)]
        out += [(segments.NO_GRAD, functools.partial(row.first_pass, self.forward, i)) for i in range(n - 1)]
        return out + [(segments.GRAD, functools.partial(train, i)) for i in reversed(range(n))]

    def empty(self, mb: data.MicroBatch, kind: str) -> None:
        """A pass that trains nothing, where this rank has no pass of ``kind`` to run (the forward is collective)."""
        targets = mb.targets[mb.select]
        if kind == segments.NO_GRAD:
            with torch.no_grad():
                self.forward(mb.input_ids, mb.select, targets, None, False)
            return
        logp, _ = self.forward(mb.input_ids, mb.select, targets, None, False)
        logp.sum().backward()


def train_step(policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any, step: data.StepBatch, *,
               parallel: Parallel, config: Config, loss_config: LossConfig) -> dict[str, Any]:
    """One optimizer step on a step batch (collective); returns batch-wide statistics (identical on every rank)."""
    computed = forward_backward(policy, step, parallel=parallel, config=config, loss_config=loss_config)
    return optimizer_step(policy, optimizer, scheduler, step, computed, parallel=parallel, learner=config.learner)


def checked_train_step(policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any, step: data.StepBatch, *,
                       check: integrity.IntegrityCheck, parallel: Parallel, config: Config,
                       loss_config: LossConfig) -> tuple[dict[str, Any], data.StepBatch, verdicts.Verdict]:
    """One optimizer step on the groups of ``step`` that pass the policy check (collective): (statistics, the
    step batch trained, the verdict on ``step``'s groups).

    The check runs before the step (evidence, and the chosen samples re-scored under every version other than
    the one the parameters hold, for workers on probation or on an audited step,
    :meth:`loraflow.learner.integrity.IntegrityCheck.run`); the failures are dropped. The
    tokens of the version the parameters hold are checked from the training forward itself
    (:class:`loraflow.learner.integrity.TrainedCheck`): optimistic, before ``optimizer.step()``; if a group fails there,
    the gradients are thrown away and forward/backward run again without it (failures are rare). The verdict
    then settles each worker's probation (:meth:`loraflow.learner.integrity.IntegrityCheck.settle`)."""
    version = check.free_version
    verdict = check.run(step, defer_version=version)
    trained = data.keep_groups(step, verdict.keep) if verdict.mismatches else step
    watch = integrity.TrainedCheck(check, trained, version) if version is not None else None
    computed = forward_backward(policy, trained, parallel=parallel, config=config, loss_config=loss_config,
                                observe=watch.observe if watch is not None and watch.pairs else None)
    if watch is not None:
        late = watch.finish()
        verdict = verdicts.merged(step, verdict, late)
        if late.mismatches:
            redone = time.monotonic()
            optimizer.zero_grad(set_to_none=True)
            trained = data.keep_groups(trained, late.keep)
            computed = forward_backward(policy, trained, parallel=parallel, config=config, loss_config=loss_config)
            redo_s = time.monotonic() - redone  # the redo is the check's cost
            verdict.seconds += redo_s
            verdict.free_seconds += redo_s
            verdict.redone = True
            check.num_redone_steps += 1
    stats = optimizer_step(policy, optimizer, scheduler, trained, computed, parallel=parallel, learner=config.learner)
    check.settle(step, verdict)
    return stats, trained, verdict


def optimizer_step(policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any, step: data.StepBatch,
                   computed: Computed, *, parallel: Parallel, learner: LearnerConfig) -> dict[str, Any]:
    """Clip, AdamW, LR schedule on the accumulated gradients (collective); the batch-wide statistics."""
    params = policy.trainable_parameters()
    max_norm = learner.grad_clip if learner.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    sums, ratio_max, num_positions = computed.sums, computed.ratio_max, computed.num_positions
    parallel.sum(sums)
    parallel.max(ratio_max)
    parallel.sum(num_positions)
    totals = dict(zip(SUM_STATS, sums.tolist(), strict=True))
    tokens = max(totals["tokens"], 1.0)
    advantages = computed.advantages
    trained = advantages[torch.tensor([s.num_trained > 0 for s in step.samples], dtype=torch.bool)]  # [N']
    return {
        "loss": totals["loss"] / tokens,
        "num_tokens": int(totals["tokens"]),
        "num_positions": int(num_positions.item()),
        "clip_frac": totals["clipped"] / tokens,
        "truncated_frac": totals["truncated"] / tokens,
        "masked_frac": totals["masked"] / tokens,
        "is_weight_mean": totals["ratio"] / tokens if totals["tokens"] else 1.0,
        "is_weight_max": float(ratio_max.item()) if totals["tokens"] else 1.0,
        "kl": totals["kl"] / tokens,
        "entropy": totals["entropy"] / tokens,
        "grad_norm": float(grad_norm),
        "lr": lr,
        "adv_mean": float(trained.mean()) if trained.numel() else 0.0,
        "adv_std": float(trained.std()) if trained.numel() > 1 else 0.0,
        "adv_abs_max": float(trained.abs().max()) if trained.numel() else 0.0,
        "num_samples": len(step.samples),
        "peak_memory_mb": round(float(parallel.max(torch.tensor([peak_memory_mb(parallel.device)]))), 1),  # max of ranks
    }


def peak_memory_mb(device: torch.device) -> float:
    """This rank's peak so far: CUDA memory allocated on a GPU, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def sync_gradients(model: torch.nn.Module, last: bool) -> Iterator[None]:
    """FSDP2 reduce-scatters gradients only in the last micro-batch's backward: the earlier ones accumulate
    unsharded gradients locally (``set_requires_gradient_sync(False)``), so a step runs one reduction per
    parameter group instead of one per micro-batch. Every rank has the same number of micro-batches."""
    model.set_requires_gradient_sync(last)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def make_optimizer(policy: Policy, learner: LearnerConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the LoRA parameters, with a linear warmup of ``learner.warmup_steps`` steps."""
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=learner.lr, weight_decay=learner.weight_decay,
                                  eps=learner.adam_eps)
    warmup = learner.warmup_steps

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) if warmup else 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
