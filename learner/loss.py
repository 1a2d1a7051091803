"""The GRPO objective as pure tensor functions: group advantages, the per-token PPO-clip loss, step statistics.

Notation, per completion token t that is trained (loss mask 1) of a sample with advantage A::

    logp_t   = log pi_theta(token)                  current policy, with gradient (loraflow.common.logprobs, worker temperature)
    behav_t  = log mu(token)                        behaviour log-prob the worker sent with the token
    rho_t    = exp(logp_t - behav_t)                importance ratio, current / behaviour (1 on fresh samples)
    s_t      = min(w_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)          PPO-clip surrogate
    loss     = sum_t keep_t * (-s_t + beta * kl_t) / N                           N = trained tokens of the batch

The weight ``w_t`` of the unclipped branch and ``keep_t`` depend on the off-policy correction (``off_policy``):

    none   w_t = rho_t                          keep_t = 1
    tis    w_t = rho_t * min(1, C / sg(rho_t))  keep_t = 1        value min(rho, C), gradient min(rho, C) A dlogp:
                                                                  the importance weight is truncated at C = tis_cap
    mask   w_t = rho_t                          keep_t = [mask_low <= sg(rho_t) <= mask_high]
                                                                  tokens whose ratio left the band are dropped

(``sg`` = stop-gradient.) With A > 0 the clip already bounds the ratio at 1 + eps_high; truncation matters for
A < 0, where plain PPO's ratio is unbounded above. ``kl_t`` is the k3 estimator of KL(pi_theta || pi_ref),
``exp(ref_t - logp_t) - (ref_t - logp_t) - 1``, against the base model (the adapter disabled), weighted by
``beta = kl_beta`` (0 = off, and the reference forward pass is skipped).

The loss is token-level: every trained token of the whole batch weighs ``1 / N`` whichever sample, micro-batch
or rank it is in, so micro-batching and the number of ranks do not change the gradient.

Group advantages (GRPO): ``A_i = r_i - mean(r_group)``, divided by the group's sample standard deviation when
``scale_by_std``. A group whose rewards are all equal (or that has one sample) has no learning signal: its
advantages are exactly 0 and it is reported so the caller can skip it and count it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-6
OFF_POLICY_MODES = ("none", "tis", "mask")


@dataclass(frozen=True, slots=True, kw_only=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    off_policy: str = "none"
    tis_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    kl_beta: float = 0.0

    def __post_init__(self) -> None:
        if self.off_policy not in OFF_POLICY_MODES:
            raise ValueError(f"off_policy must be one of {OFF_POLICY_MODES}, got {self.off_policy!r}")

    @classmethod
    def from_learner(cls, learner) -> LossConfig:
        """From a :class:`loraflow.common.config.LearnerConfig` (clip_eps_high 0 means the same as clip_eps)."""
        return cls(clip_low=learner.clip_eps, clip_high=learner.clip_eps_high or learner.clip_eps,
                   off_policy=learner.off_policy, tis_cap=learner.tis_cap, mask_low=learner.mask_low,
                   mask_high=learner.mask_high, kl_beta=learner.kl_beta)


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int, *,
                     scale_by_std: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages of samples that belong to groups.

    rewards [N] float, group_index [N] int in [0, num_groups)  ->  advantages [N] f32, zero_variance [G] bool.
    A group of one sample, or whose rewards are all equal (std < 1e-6), gets advantages of exactly 0.
    """
    rewards = rewards.to(torch.float64)  # the mean and std of a few rewards, exactly enough to compare with 0
    index = group_index.long()
    counts = torch.bincount(index, minlength=num_groups).to(torch.float64)             # [G]
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, rewards)  # [G]
    mean = sums / counts.clamp(min=1)                                                 # [G]
    centered = rewards - mean[index]                                                  # [N]
    squares = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, centered.square())
    std = (squares / (counts - 1).clamp(min=1)).sqrt()                                # [G] sample std
    zero_variance = (counts < 2) | (std < STD_EPS)                                    # [G]
    advantages = centered / (std[index] + STD_EPS) if scale_by_std else centered      # [N]
    advantages = torch.where(zero_variance[index], torch.zeros_like(advantages), advantages)
    return advantages.to(torch.float32), zero_variance


@dataclass(slots=True, kw_only=True)
class TokenTerms:
    """Per-token loss terms of the trained tokens of one micro-batch (all [T]; T may be 0)."""

    loss: torch.Tensor       # [T] f32, keep * (-s + beta * kl), with gradient; sum it and divide by N
    ratio: torch.Tensor      # [T] f32, rho detached
    clipped: torch.Tensor    # [T] bool, the clip branch is taken (no gradient from the surrogate)
    truncated: torch.Tensor  # [T] bool, tis: the importance weight was capped
    kept: torch.Tensor       # [T] bool, mask: the token stayed in the band (all True otherwise)
    kl: torch.Tensor         # [T] f32, k3 estimate detached (zeros when beta = 0)


def token_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig,
               ref_logp: torch.Tensor | None = None) -> TokenTerms:
    """PPO-clip loss terms with the configured off-policy correction (see the module docstring).

    logp [T] f32 (with gradient), behaviour_logp [T] f32, advantages [T] f32, ref_logp [T] f32 or None -> TokenTerms.
    """
    log_ratio = logp - behaviour_logp                                        # [T]
    ratio = torch.exp(log_ratio)                                             # [T] value rho, d/dlogp = rho
    ratio_value = ratio.detach()
    weight = ratio
    truncated = torch.zeros_like(ratio_value, dtype=torch.bool)
    if config.off_policy == "tis":
        truncated = ratio_value > config.tis_cap
        weight = ratio * (config.tis_cap / ratio_value).clamp(max=1.0)      # value and gradient min(rho, C)
    clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    unclipped_term = weight * advantages                                     # [T]
    clipped_term = clipped_ratio * advantages                                # [T]
    surrogate = torch.minimum(unclipped_term, clipped_term)                  # [T]
    outside = (ratio_value < 1.0 - config.clip_low) | (ratio_value > 1.0 + config.clip_high)
    clipped = outside & (clipped_term.detach() < unclipped_term.detach())
    loss = -surrogate
    kl = torch.zeros_like(ratio_value)
    if config.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("kl_beta > 0 needs the reference (adapter disabled) log-probs")
        delta = ref_logp - logp                                              # [T]
        kl_term = torch.exp(delta) - delta - 1.0                             # [T] k3 >= 0
        loss = loss + config.kl_beta * kl_term
        kl = kl_term.detach()
    kept = torch.ones_like(ratio_value, dtype=torch.bool)
    if config.off_policy == "mask":
        kept = (ratio_value >= config.mask_low) & (ratio_value <= config.mask_high)
        loss = loss * kept
    return TokenTerms(loss=loss, ratio=ratio_value, clipped=clipped, truncated=truncated, kept=kept, kl=kl)


#: order of the summed statistics in :func:`token_stats` (all-reduced with SUM across ranks)
SUM_STATS = ("loss", "tokens", "clipped", "truncated", "masked", "ratio", "kl", "entropy")


def token_stats(terms: TokenTerms, entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of a micro-batch's token terms (order SUM_STATS) and the ratio max: ([len(SUM_STATS)] f64, [1] f64).

    entropy [T] f32 per trained token. Divide the sums by the batch's token count to get means.
    """
    device = terms.ratio.device
    sums = torch.stack([
        terms.loss.detach().double().sum(),
        torch.tensor(float(terms.ratio.numel()), dtype=torch.float64, device=device),
        terms.clipped.double().sum(),
        terms.truncated.double().sum(),
        (~terms.kept).double().sum(),
        terms.ratio.double().sum(),
        terms.kl.double().sum(),
        entropy.detach().double().sum(),
    ])
    ratio_max = (terms.ratio.double().max().reshape(1) if terms.ratio.numel()
                 else torch.zeros(1, dtype=torch.float64, device=device))
    return sums, ratio_max
