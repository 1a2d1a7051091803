"""One optimizer step on a step batch: this rank's micro-batches through the loss, backward, clip, AdamW.

Every rank calls :func:`train_step` with the same :class:`learner.data.StepBatch`; each trains its share of the
samples (``data.rank_micro_batches``), and FSDP2 reduce-scatters the LoRA gradients once, in the last
micro-batch's backward (:func:`sync_gradients`). Log-probs come from the trained positions only
(:meth:`learner.model.Policy.trained_logprobs`: no ``[B, L, V]`` logits). Each trained token of the
batch weighs ``1 / N`` (N = trained tokens of the whole batch, known to every rank), and FSDP2 averages over
the R ranks, so each rank scales its loss by ``R / N``: the gradient is that of one process on the whole batch.
Statistics are summed over micro-batches and ranks, so every rank returns the same numbers.

The learner loop calls :func:`checked_train_step`: the policy check (:mod:`learner.integrity`) around the same
forward/backward (:func:`forward_backward`), whose log-probs check the tokens of the version the parameters
hold before :func:`optimizer_step`; a group failing there costs one more forward/backward without it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.config import Config, LearnerConfig
from learner import data, integrity
from learner.loss import SUM_STATS, LossConfig, group_advantages, token_loss, token_stats
from learner.model import Policy
from learner.parallel import Parallel


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
    (collective). ``observe(rows, logp)`` sees each micro-batch's sample indices and trained log-probs [T]."""
    learner = config.learner
    temperature = config.worker.temperature
    advantages, _ = group_advantages(step.rewards, step.group_index, step.num_groups,
                                     scale_by_std=learner.scale_by_std)                      # [N]
    micro_batches = data.rank_micro_batches(step, advantages, rank=parallel.rank, world_size=parallel.world_size,
                                            budget_tokens=learner.micro_batch_tokens)
    scale = parallel.world_size / max(step.num_trained_tokens, 1)
    out = Computed(advantages=advantages, sums=torch.zeros(len(SUM_STATS), dtype=torch.float64),
                   ratio_max=torch.zeros(1, dtype=torch.float64), num_positions=torch.zeros(1, dtype=torch.float64))
    for index, micro in enumerate(micro_batches):
        mb = micro.to(parallel.device)
        targets = mb.targets[mb.select]                                                      # [T]
        ref_logp = None
        if loss_config.kl_beta > 0:
            with torch.no_grad(), policy.reference():
                ref_logp, _ = policy.trained_logprobs(mb.input_ids, mb.select, targets, temperature,
                                                      with_entropy=False)                    # [T]
        logp, entropy = policy.trained_logprobs(mb.input_ids, mb.select, targets, temperature)  # [T], [T]
        if observe is not None:
            observe(micro.rows, logp)
        terms = token_loss(logp, mb.behaviour_logp, mb.advantages, loss_config, ref_logp)
        with sync_gradients(policy.model, index == len(micro_batches) - 1):
            (terms.loss.sum() * scale).backward()
        micro_sums, micro_max = token_stats(terms, entropy)
        out.sums += micro_sums.cpu()
        out.ratio_max = torch.maximum(out.ratio_max, micro_max.cpu())
        out.num_positions += float(micro.num_positions if micro.num_samples else 0)
    return out


def train_step(policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any, step: data.StepBatch, *,
               parallel: Parallel, config: Config, loss_config: LossConfig) -> dict[str, Any]:
    """One optimizer step on a step batch (collective); returns batch-wide statistics (identical on every rank)."""
    computed = forward_backward(policy, step, parallel=parallel, config=config, loss_config=loss_config)
    return optimizer_step(policy, optimizer, scheduler, step, computed, parallel=parallel, learner=config.learner)


def checked_train_step(policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any, step: data.StepBatch, *,
                       check: integrity.IntegrityCheck, parallel: Parallel, config: Config,
                       loss_config: LossConfig) -> tuple[dict[str, Any], data.StepBatch, integrity.Verdict]:
    """One optimizer step on the groups of ``step`` that pass the policy check (collective): (statistics, the
    step batch trained, the verdict on ``step``'s groups).

    The check runs before the step (evidence, and the chosen samples re-scored under every version other than
    the one the parameters hold, :meth:`learner.integrity.IntegrityCheck.run`); the failures are dropped. The
    tokens of the version the parameters hold are checked from the training forward itself
    (:class:`learner.integrity.TrainedCheck`): optimistic, before ``optimizer.step()``; if a group fails there,
    the gradients are thrown away and forward/backward run again without it (failures are rare)."""
    version = check.free_version
    verdict = check.run(step, defer_version=version)
    trained = data.keep_groups(step, verdict.keep) if verdict.mismatches else step
    watch = integrity.TrainedCheck(check, trained, version) if version is not None else None
    computed = forward_backward(policy, trained, parallel=parallel, config=config, loss_config=loss_config,
                                observe=watch.observe if watch is not None and watch.pairs else None)
    if watch is not None:
        late = watch.finish()
        verdict = integrity.merged(step, verdict, late)
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
