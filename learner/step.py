"""One optimizer step on a step batch: this rank's micro-batches through the loss, backward, clip, AdamW.

Every rank calls :func:`train_step` with the same :class:`learner.data.StepBatch`; each trains its share of the
samples (``data.rank_micro_batches``), and FSDP2 reduce-scatters the LoRA gradients once, in the last
micro-batch's backward (:func:`sync_gradients`). Log-probs come from the trained positions only
(:meth:`learner.model.Policy.trained_logprobs`: no ``[B, L, V]`` logits). Each trained token of the
batch weighs ``1 / N`` (N = trained tokens of the whole batch, known to every rank), and FSDP2 averages over
the R ranks, so each rank scales its loss by ``R / N``: the gradient is that of one process on the whole batch.
Statistics are summed over micro-batches and ranks, so every rank returns the same numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from common.config import Config, LearnerConfig
from learner import data
from learner.loss import SUM_STATS, LossConfig, group_advantages, token_loss, token_stats
from learner.model import Policy
from learner.parallel import Parallel


def train_step(policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any, step: data.StepBatch, *,
               parallel: Parallel, config: Config, loss_config: LossConfig) -> dict[str, Any]:
    """One optimizer step on a step batch (collective); returns batch-wide statistics (identical on every rank)."""
    learner = config.learner
    temperature = config.worker.temperature
    advantages, _ = group_advantages(step.rewards, step.group_index, step.num_groups,
                                     scale_by_std=learner.scale_by_std)                      # [N]
    micro_batches = data.rank_micro_batches(step, advantages, rank=parallel.rank, world_size=parallel.world_size,
                                            budget_tokens=learner.micro_batch_tokens)
    scale = parallel.world_size / max(step.num_trained_tokens, 1)
    sums = torch.zeros(len(SUM_STATS), dtype=torch.float64)
    ratio_max = torch.zeros(1, dtype=torch.float64)
    num_positions = torch.zeros(1, dtype=torch.float64)
    for index, micro in enumerate(micro_batches):
        mb = micro.to(parallel.device)
        targets = mb.targets[mb.select]                                                      # [T]
        ref_logp = None
        if loss_config.kl_beta > 0:
            with torch.no_grad(), policy.reference():
                ref_logp, _ = policy.trained_logprobs(mb.input_ids, mb.select, targets, temperature,
                                                      with_entropy=False)                    # [T]
        logp, entropy = policy.trained_logprobs(mb.input_ids, mb.select, targets, temperature)  # [T], [T]
        terms = token_loss(logp, mb.behaviour_logp, mb.advantages, loss_config, ref_logp)
        with sync_gradients(policy.model, index == len(micro_batches) - 1):
            (terms.loss.sum() * scale).backward()
        micro_sums, micro_max = token_stats(terms, entropy)
        sums += micro_sums.cpu()
        ratio_max = torch.maximum(ratio_max, micro_max.cpu())
        num_positions += float(micro.num_positions if micro.num_samples else 0)
    params = policy.trainable_parameters()
    max_norm = learner.grad_clip if learner.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    parallel.sum(sums)
    parallel.max(ratio_max)
    parallel.sum(num_positions)
    totals = dict(zip(SUM_STATS, sums.tolist(), strict=True))
    tokens = max(totals["tokens"], 1.0)
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
