"""Policy versions and staleness: the arithmetic every role must agree on.

- A policy version is an int; v0 is the base model with a zero adapter. Each adapter the learner publishes
  is the previous version + 1.
- Every generated token carries the version that produced it; a group's ``min_version`` is its oldest,
  ``max_version`` its newest.
- Staleness of a token when trained = learner version at train time - the version that generated it.
  ``max_staleness`` bounds it, token by token (:class:`StalenessRule`, ``NEWEST_TOKEN``): a token is trained
  only if its version is at least :func:`oldest_trainable` (``learner version - max_staleness``); the older
  tokens of a sample get loss mask 0 in the learner (:func:`stale_tokens`; they stay in the context the model
  reads, and are counted as ``tokens_masked_stale``), and a group is kept while its *newest* token is within the
  bound (:func:`group_is_too_stale`). Under ``worker.partial_policy = "continue"`` a long sample spans versions:
  its early tokens age while it generates, its last ones are fresh, so a long group is no more likely to be
  dropped than a short one (bench/staleness_lengths.py). Judged by its oldest token instead (``OLDEST_TOKEN``,
  the rule before), the longest completions were the ones dropped, biasing training toward short answers.
- The broker leases only to workers whose adapter is recent enough that what they generate can still be
  trained, admits no more groups than the learner can consume within the bound (AReaL's rule), and drops
  buffered groups whose newest token aged past it; the learner checks again before training and masks the
  stale tokens of what it trains. A group's staleness, as the histograms count it (the broker's buffer and
  served groups, the learner's ``staleness`` per step), is its newest token's: never above ``max_staleness``
  for a group trained; how much older its oldest tokens were shows as ``tokens_masked_stale``.
- Withdrawn versions: a learner that dies loses the steps after its last checkpoint. The versions it published
  after that checkpoint are *withdrawn* (inclusive ranges ``(lo, hi)``): their numbers are never used again, no
  token generated under them is ever trained, and the resumed learner publishes its checkpoint's weights under
  a new number above all of them. :func:`withdraw` merges a range in, :func:`overlaps` and :func:`touches`
  test a group's version span and its per-token versions against them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

VersionRange = tuple[int, int]  # inclusive (lo, hi)


def staleness(learner_version: int, oldest_token_version: int) -> int:
    """Versions between the policy that generated the oldest token and the one being trained."""
    return learner_version - oldest_token_version


def is_too_stale(learner_version: int, oldest_token_version: int, max_staleness: int) -> bool:
    return staleness(learner_version, oldest_token_version) > max_staleness


class StalenessRule(enum.StrEnum):
    """Which token of a group decides whether the group is too stale to train."""

    NEWEST_TOKEN = "newest_token"  # the rule: kept while any token is within the bound; older tokens masked
    OLDEST_TOKEN = "oldest_token"  # the rule before (kept for the bench's before/after): dropped once any token
                                   # is past the bound


def oldest_trainable(learner_version: int, max_staleness: int) -> int:
    """The oldest version whose tokens a learner at ``learner_version`` still trains."""
    return learner_version - max_staleness


def group_is_too_stale(learner_version: int, min_version: int, max_version: int, max_staleness: int,
                       rule: StalenessRule = StalenessRule.NEWEST_TOKEN) -> bool:
    """Whether a group whose tokens span [min_version, max_version] is dropped whole (see the module docstring)."""
    deciding = max_version if rule is StalenessRule.NEWEST_TOKEN else min_version
    return is_too_stale(learner_version, deciding, max_staleness)


def stale_tokens(token_versions: Any, learner_version: int, max_staleness: int) -> Any:
    """Which of the per-token versions (a numpy array or torch tensor of ints) are too old to train: a bool
    array of the same shape (the learner gives these tokens loss mask 0)."""
    return token_versions < oldest_trainable(learner_version, max_staleness)


def worker_may_generate(worker_version: int, learner_version: int, max_staleness: int) -> bool:
    """A worker may start a group only if its adapter is within the bound of the learner's newest version."""
    return not is_too_stale(learner_version, worker_version, max_staleness)


def admission_limit(learner_version: int, max_staleness: int, groups_per_step: int, num_trained_groups: int = 0,
                    base_version: int = 0) -> int:
    """Groups that may be started (leased, buffered) now without any of them outliving the staleness bound.

    Groups started before the learner reaches version v + max_staleness + 1 are all trained by then only if no
    more than (max_staleness + 1 + steps done) x groups_per_step were ever started. ``num_trained_groups``
    counts groups already trained; ``base_version`` is the version counting started from (a resumed run).
    Returns how many groups may be in flight (leased + buffered + in training) at most.
    """
    steps_done = learner_version - base_version
    return max(0, (max_staleness + 1 + steps_done) * groups_per_step - num_trained_groups)


def withdraw(ranges: Iterable[VersionRange], lo: int, hi: int) -> list[VersionRange]:
    """``ranges`` with ``[lo, hi]`` merged in (sorted, disjoint, adjacent ranges joined); unchanged if lo > hi."""
    merged: list[VersionRange] = []
    for start, end in sorted([*ranges, (lo, hi)] if lo <= hi else list(ranges)):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def is_withdrawn(ranges: Sequence[VersionRange], version: int) -> bool:
    return any(lo <= version <= hi for lo, hi in ranges)


def overlaps(ranges: Sequence[VersionRange], min_version: int, max_version: int) -> bool:
    """Whether a group whose tokens span [min_version, max_version] may hold a withdrawn token."""
    return any(lo <= max_version and min_version <= hi for lo, hi in ranges)


def touches(ranges: Sequence[VersionRange], token_versions: Any) -> bool:
    """Whether any of the per-token versions (a numpy array or torch tensor of ints) is withdrawn."""
    return any(bool(((token_versions >= lo) & (token_versions <= hi)).any()) for lo, hi in ranges)
