"""loraflow.learner.trust: probation counts and the secret per-step audit draw."""

from __future__ import annotations

import secrets

from loraflow.learner.trust import Trust


def test_probation_needs_passes_in_a_row_and_a_failure_starts_it_again() -> None:
    trust = Trust(probation_groups=3, audit_fraction=0.5, seed=1)
    assert trust.on_probation("w#a")
    trust.passed("w#a")
    trust.passed("w#a")
    trust.failed("w#a")
    trust.passed("w#a")
    trust.passed("w#a")
    assert trust.on_probation("w#a")
    trust.passed("w#a")
    assert not trust.on_probation("w#a") and trust.on_probation("w#b") and trust.num_trusted() == 1


def test_no_probation_when_it_is_zero_groups() -> None:
    assert not Trust(probation_groups=0, audit_fraction=0.5, seed=1).on_probation("new#x")


def test_the_audit_draw_is_the_same_on_every_rank_and_near_its_fraction() -> None:
    seed = secrets.randbits(62)
    ranks = [Trust(probation_groups=1, audit_fraction=0.125, seed=seed) for _ in range(2)]
    steps = [[f"{k}:{j}" for j in range(4)] for k in range(4000)]
    draws = [[t.audited(ids) for ids in steps] for t in ranks]
    assert draws[0] == draws[1]
    assert 0.10 < sum(draws[0]) / len(steps) < 0.15
    other = Trust(probation_groups=1, audit_fraction=0.125, seed=seed + 1)
    assert [other.audited(ids) for ids in steps] != draws[0]  # a worker without the seed cannot tell which
    assert all(Trust(probation_groups=1, audit_fraction=1.0, seed=seed).audited(ids) for ids in steps[:50])


def test_memory_is_bounded_and_a_forgotten_worker_is_on_probation_again() -> None:
    trust = Trust(probation_groups=1, audit_fraction=0.5, seed=1, max_workers=2)
    for name in ("a", "b", "c"):
        trust.passed(name)
    assert trust.on_probation("a") and not trust.on_probation("c")
