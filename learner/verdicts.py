"""The policy check's verdict on a step batch (:mod:`loraflow.learner.integrity`): which groups are trained, one
PolicyMismatch per failed group, and what the check cost; merged over the two paths of a step, and logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraflow.common.logging import get_logger
from loraflow.common.protocol import PolicyMismatch
from loraflow.learner import data

log = get_logger("learner.integrity")

#: a reported |diff| is capped here (an infinite one still fails; the wire and the JSON log want finite numbers)
MAX_REPORTED_DIFF = 1e9


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


def log_mismatches(verdict: Verdict) -> None:
    """One ``policy_mismatch`` warning per failed group, with its evidence (rank 0)."""
    for m in verdict.mismatches:
        log.warning("policy_mismatch", group_id=m.group_id, worker_id=m.worker_id, reason=m.reason,
                    version=m.version, num_checked=m.num_checked, num_off=m.num_off,
                    max_abs_diff=round(m.max_abs_diff, 6), mean_abs_diff=round(m.mean_abs_diff, 6), detail=m.detail)
