"""loraflow.learner.loss against hand-computed values, edge cases, and a loop-based reference on random inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.learner.loss import SUM_STATS, LossConfig, group_advantages, token_loss, token_stats

PPO = LossConfig(clip_low=0.2, clip_high=0.2, off_policy="none")


def loss_and_grad(logp: list[float], behaviour: list[float], adv: list[float], config: LossConfig,
                  ref: list[float] | None = None):
    lp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    terms = token_loss(lp, torch.tensor(behaviour), torch.tensor(adv),
                       config, None if ref is None else torch.tensor(ref))
    terms.loss.sum().backward()
    return terms, lp.grad


# -- hand-computed values ------------------------------------------------------------------------------------


def test_ppo_clip_hand_computed() -> None:
    # rho = 1.5 / 1.5 / 0.5 / 0.5 against advantages +1 / -1 / -1 / +1, clip 0.2
    log15, log05 = math.log(1.5), math.log(0.5)
    terms, grad = loss_and_grad([log15, log15, log05, log05], [0, 0, 0, 0], [1, -1, -1, 1], PPO)
    # A=+1, rho 1.5: min(1.5, 1.2) -> clipped at 1.2, no gradient
    # A=-1, rho 1.5: min(-1.5, -1.2) = -1.5 -> loss 1.5, d/dlogp = -A * rho = 1.5
    # A=-1, rho 0.5: min(-0.5, -0.8) = -0.8 -> clipped, loss 0.8, no gradient
    # A=+1, rho 0.5: min(0.5, 0.8) = 0.5 -> loss -0.5, d/dlogp = -0.5
    assert terms.loss.tolist() == pytest.approx([-1.2, 1.5, 0.8, -0.5], abs=1e-6)
    assert grad.tolist() == pytest.approx([0.0, 1.5, 0.0, -0.5], abs=1e-6)
    assert terms.clipped.tolist() == [True, False, True, False]
    assert terms.ratio.tolist() == pytest.approx([1.5, 1.5, 0.5, 0.5], abs=1e-6)


def test_asymmetric_clip_range() -> None:
    config = LossConfig(clip_low=0.2, clip_high=0.28, off_policy="none")
    terms, grad = loss_and_grad([math.log(1.25), math.log(1.3)], [0, 0], [1, 1], config)
    assert terms.loss.tolist() == pytest.approx([-1.25, -1.28], abs=1e-6)  # 1.25 inside, 1.3 clipped at 1.28
    assert grad.tolist() == pytest.approx([-1.25, 0.0], abs=1e-6)


def test_truncated_is_caps_the_weight_and_keeps_the_gradient() -> None:
    config = LossConfig(off_policy="tis", tis_cap=1.25)
    terms, grad = loss_and_grad([math.log(1.5), math.log(1.1)], [0, 0], [-1, -1], config)
    # rho 1.5 > C: weight 1.25; min(-1.25, -1.2) = -1.25 -> loss 1.25, gradient -A * C = 1.25
    # rho 1.1 < C: plain PPO, loss 1.1, gradient 1.1
    assert terms.loss.tolist() == pytest.approx([1.25, 1.1], abs=1e-6)
    assert grad.tolist() == pytest.approx([1.25, 1.1], abs=1e-6)
    assert terms.truncated.tolist() == [True, False]


def test_truncation_edges() -> None:
    config = LossConfig(off_policy="tis", tis_cap=2.0)
    at_cap = [math.log(2.0)] * 2
    terms, grad = loss_and_grad(at_cap, [0, 0], [-1, -1], config)
    assert not terms.truncated.any()  # exactly at the cap is not truncated
    assert grad.tolist() == pytest.approx([2.0, 2.0], rel=1e-6)
    above = [math.log(2.0) + 1e-3, math.log(50.0)]
    terms, grad = loss_and_grad(above, [0, 0], [-1, -1], config)
    assert terms.truncated.all()
    assert grad.tolist() == pytest.approx([2.0, 2.0], rel=1e-6)  # never more than the cap, however stale
    plain, plain_grad = loss_and_grad(above, [0, 0], [-1, -1], PPO)
    assert plain_grad[1].item() == pytest.approx(50.0, rel=1e-5)  # what the cap prevents


def test_ratio_band_mask_edges() -> None:
    config = LossConfig(off_policy="mask", mask_low=0.5, mask_high=2.0)
    logp = [math.log(0.5), math.log(0.5) - 1e-4, math.log(2.0), math.log(2.0) + 1e-4, 0.0]
    terms, grad = loss_and_grad(logp, [0.0] * 5, [1, 1, -1, -1, 1], config)
    assert terms.kept.tolist() == [True, False, True, False, True]
    assert terms.loss[1].item() == 0 and terms.loss[3].item() == 0
    assert grad[1].item() == 0 and grad[3].item() == 0
    assert grad[0].item() == pytest.approx(-0.5, rel=1e-5)  # inside the band, rho 0.5 < 0.8: unclipped
    assert grad[4].item() == pytest.approx(-1.0, rel=1e-6)


def test_fresh_samples_have_ratio_one_and_plain_policy_gradient() -> None:
    gen = torch.Generator().manual_seed(3)
    behaviour = -torch.rand(50, generator=gen) * 5
    adv = torch.randn(50, generator=gen)
    for mode in ("none", "tis", "mask"):
        lp = behaviour.clone().requires_grad_(True)
        terms = token_loss(lp, behaviour, adv, LossConfig(off_policy=mode))
        terms.loss.sum().backward()
        assert torch.equal(terms.ratio, torch.ones(50))
        assert not terms.clipped.any() and not terms.truncated.any() and terms.kept.all()
        torch.testing.assert_close(terms.loss, -adv)
        torch.testing.assert_close(lp.grad, -adv)  # REINFORCE: -A dlogp


def test_kl_penalty_k3_hand_computed() -> None:
    config = LossConfig(kl_beta=0.5)
    logp, ref = math.log(0.5), math.log(0.25)
    terms, grad = loss_and_grad([logp], [logp], [0.0], config, ref=[ref])
    delta = ref - logp  # k3 = exp(delta) - delta - 1; d/dlogp = 1 - exp(delta)
    assert terms.kl.item() == pytest.approx(math.exp(delta) - delta - 1, rel=1e-6)
    assert terms.loss.item() == pytest.approx(0.5 * (math.exp(delta) - delta - 1), rel=1e-6)
    assert grad.item() == pytest.approx(0.5 * (1 - math.exp(delta)), rel=1e-6)
    with pytest.raises(ValueError, match="reference"):
        token_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), config)


def test_group_advantages_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    index = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, zero = group_advantages(rewards, index, 2, scale_by_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0])
    assert zero.tolist() == [False, False]
    adv, _ = group_advantages(rewards, index, 2, scale_by_std=True)
    # group 0: sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 1: sqrt(2) (sample std of {2, 4})
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, -1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-5)


def test_zero_variance_and_single_sample_groups_give_exact_zeros() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 5.0])
    index = torch.tensor([0, 0, 0, 1, 1, 2])  # group 2 has a single sample
    for scale in (True, False):
        adv, zero = group_advantages(rewards, index, 3, scale_by_std=scale)
        assert zero.tolist() == [True, False, True]
        assert adv[:3].tolist() == [0.0, 0.0, 0.0] and adv[5].item() == 0.0
        assert torch.isfinite(adv).all()


def test_empty_inputs_give_finite_zeros() -> None:
    adv, zero = group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), 0, scale_by_std=True)
    assert adv.numel() == 0 and zero.numel() == 0
    empty = torch.zeros(0, requires_grad=True)
    for mode in ("none", "tis", "mask"):
        terms = token_loss(empty, torch.zeros(0), torch.zeros(0), LossConfig(off_policy=mode, kl_beta=0.1),
                           ref_logp=torch.zeros(0))
        sums, ratio_max = token_stats(terms, torch.zeros(0))
        total = terms.loss.sum()
        total.backward()
        assert total.item() == 0 and torch.isfinite(sums).all() and sums.abs().sum() == 0
        assert ratio_max.item() == 0


def test_token_stats_sums() -> None:
    config = LossConfig(off_policy="mask", mask_low=0.6, mask_high=1.4)
    terms, _ = loss_and_grad([math.log(1.3), math.log(0.5), 0.0], [0, 0, 0], [1, 1, 1], config)
    sums, ratio_max = token_stats(terms, torch.tensor([1.0, 2.0, 3.0]))
    stats = dict(zip(SUM_STATS, sums.tolist(), strict=True))
    assert stats["tokens"] == 3 and stats["clipped"] == 1 and stats["masked"] == 1
    assert stats["ratio"] == pytest.approx(1.3 + 0.5 + 1.0, rel=1e-6) and stats["entropy"] == 6.0
    assert stats["loss"] == pytest.approx(-1.2 + 0 - 1.0, rel=1e-6)
    assert ratio_max.item() == pytest.approx(1.3, rel=1e-6)


# -- against an independent loop-based implementation --------------------------------------------------------


def reference_token(lp: float, bl: float, a: float, ref: float, c: LossConfig) -> tuple[float, float]:
    """(loss, d loss / d logp) of one token, written out case by case with floats."""
    rho = math.exp(lp - bl)
    if c.off_policy == "mask" and not c.mask_low <= rho <= c.mask_high:
        return 0.0, 0.0
    weight = min(rho, c.tis_cap) if c.off_policy == "tis" else rho  # d(weight)/dlogp == weight
    unclipped, d_unclipped = weight * a, weight * a
    lo, hi = 1 - c.clip_low, 1 + c.clip_high
    if rho < lo:
        clipped, d_clipped = lo * a, 0.0
    elif rho > hi:
        clipped, d_clipped = hi * a, 0.0
    else:
        clipped, d_clipped = rho * a, rho * a
    if unclipped < clipped:
        surrogate, d_surrogate = unclipped, d_unclipped
    elif clipped < unclipped:
        surrogate, d_surrogate = clipped, d_clipped
    else:  # a tie: both branches share the gradient, as torch.minimum does
        surrogate, d_surrogate = unclipped, (d_unclipped + d_clipped) / 2
    loss, grad = -surrogate, -d_surrogate
    if c.kl_beta > 0:
        delta = ref - lp
        loss += c.kl_beta * (math.exp(delta) - delta - 1)
        grad += c.kl_beta * (1 - math.exp(delta))
    return loss, grad


def reference_advantages(rewards: list[float], groups: list[int], scale: bool) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1)) if len(members) > 1 else 0.0
        if len(members) < 2 or std < 1e-6:
            out.append(0.0)
        else:
            out.append((r - mean) / (std + 1e-6) if scale else r - mean)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_token_loss_matches_loop_reference_on_random_inputs(seed: int) -> None:
    rng = random.Random(seed)
    config = LossConfig(clip_low=rng.choice([0.1, 0.2]), clip_high=rng.choice([0.2, 0.28]),
                        off_policy=("none", "tis", "mask")[seed % 3], tis_cap=rng.choice([1.1, 2.0]),
                        mask_low=0.5, mask_high=rng.choice([1.5, 2.0]), kl_beta=rng.choice([0.0, 0.05]))
    n = rng.randint(1, 64)
    behaviour = [-rng.uniform(0.01, 6) for _ in range(n)]
    logp = [b + rng.gauss(0, 0.6) for b in behaviour]  # ratios spread well past every clip and band edge
    adv = [rng.gauss(0, 1) for _ in range(n)]
    ref = [b + rng.gauss(0, 0.3) for b in behaviour]
    terms, grad = loss_and_grad(logp, behaviour, adv, config, ref=ref)
    expected = [reference_token(lp, bl, a, r, config) for lp, bl, a, r in zip(logp, behaviour, adv, ref, strict=True)]
    assert terms.loss.tolist() == pytest.approx([e[0] for e in expected], rel=1e-4, abs=1e-5)
    assert grad.tolist() == pytest.approx([e[1] for e in expected], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_group_advantages_match_loop_reference(seed: int) -> None:
    rng = random.Random(seed)
    num_groups = rng.randint(1, 6)
    groups = [g for g in range(num_groups) for _ in range(rng.randint(1, 8))]
    rng.shuffle(groups)
    rewards = [float(rng.choice([0, 1])) if seed % 2 else rng.uniform(-2, 2) for _ in groups]
    for scale in (True, False):
        adv, _ = group_advantages(torch.tensor(rewards), torch.tensor(groups), num_groups, scale_by_std=scale)
        assert adv.tolist() == pytest.approx(reference_advantages(rewards, groups, scale), rel=1e-5, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 3.25]), min_size=1, max_size=9), min_size=1,
                max_size=6), st.booleans())
def test_group_advantages_properties(groups: list[list[float]], scale: bool) -> None:
    rewards = torch.tensor([r for g in groups for r in g])
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    adv, zero = group_advantages(rewards, index, len(groups), scale_by_std=scale)
    assert torch.isfinite(adv).all()
    for i, g in enumerate(groups):
        members = adv[index == i]
        assert bool(zero[i]) == (len(set(g)) == 1)  # no signal exactly when all rewards are equal
        assert abs(float(members.sum())) < 1e-4  # centred within the group
        if zero[i]:
            assert members.abs().max() == 0
        elif scale:
            assert float(members.std()) == pytest.approx(1.0, rel=1e-4)  # unit sample std
