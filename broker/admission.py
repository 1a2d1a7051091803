"""Credit-based admission: how many prompt leases one worker may be granted right now, and if not, why.

A lease is a promise to buffer one more group, so the broker grants one only when that group can still be
trained and stored. For a LeaseRequest the answer is the smallest of these limits; the tightest one (the
earliest in this order on a tie) is the reason sent back in an empty or short LeaseGrant::

    stale_adapter  the worker's adapter is more than max_staleness behind the newest version
                   (versions.worker_may_generate), or a version a restarted learner withdrew: it must
                   fetch the newest adapter first
    draining       the broker is shutting down
    limit          the worker already holds broker.max_leases_per_worker leases
    backpressure   in flight (leased + buffered + training) would exceed capacity_groups, or
                   versions.admission_limit (AReaL's rule: no group may outlive the staleness bound), or the
                   byte bound projected from the mean group size seen so far

The admission limit is taken at the *worker's* adapter version: a group generated with version w is
trained behind everything already in flight, so it stays within the bound only while in flight <
(max_staleness + 1 + w - base) x groups_per_step - trained. A worker one version behind therefore gets less
credit than an up-to-date one; when that is what holds it back, the reason is ``stale_adapter`` (fetch the
newest adapter, then ask again) rather than generating groups that would be dropped as stale.
    no_prompts     the prompt source has nothing left (all epochs issued, nothing re-queued)

Pure logic, unit-tested: the server gathers the inputs into an :class:`AdmissionInputs` and sends what
:func:`decide` returns. Workers wait (long-poll) while the answer is zero; nothing is generated that the
learner could not use.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraflow.common import versions


@dataclass(slots=True, kw_only=True)
class AdmissionInputs:
    requested: int  # LeaseRequest.max_leases
    worker_version: int  # the adapter version the worker holds
    latest_version: int  # the newest published version
    max_staleness: int
    groups_per_step: int
    capacity_groups: int
    num_leased: int
    num_stored: int  # buffered + training groups
    num_trained_groups: int  # groups trained since base_version
    base_version: int  # version at which counting started (the broker's start)
    worker_leases: int  # leases this worker holds
    max_leases_per_worker: int
    stored_bytes: int  # buffered + training bytes
    mean_group_bytes: float  # 0 = no group seen yet (no byte projection)
    max_buffer_bytes: int
    prompts_available: int  # what the prompt source can hand out (capped at ``requested``)
    draining: bool = False
    worker_withdrawn: bool = False  # the worker's adapter is a withdrawn version


@dataclass(frozen=True, slots=True)
class Decision:
    num_leases: int
    reason: str  # "" when everything requested is granted


def credit(inputs: AdmissionInputs, version: int | None = None) -> int:
    """Groups that may still start with adapter ``version`` (default: the worker's): capacity, the
    staleness-safe admission limit and the byte bound."""
    in_flight = inputs.num_leased + inputs.num_stored
    version = inputs.worker_version if version is None else version
    limit = min(inputs.capacity_groups,
                versions.admission_limit(version, inputs.max_staleness, inputs.groups_per_step,
                                         inputs.num_trained_groups, inputs.base_version))
    free = limit - in_flight
    if inputs.mean_group_bytes > 0:
        room = inputs.max_buffer_bytes - inputs.stored_bytes - inputs.num_leased * inputs.mean_group_bytes
        by_bytes = int(room // inputs.mean_group_bytes)
        if in_flight == 0:
            by_bytes = max(by_bytes, 1)  # one group always fits an empty buffer
        free = min(free, by_bytes)
    return max(0, free)


def decide(inputs: AdmissionInputs) -> Decision:
    """How many leases to grant now (<= requested) and why not more."""
    if inputs.worker_withdrawn or not versions.worker_may_generate(inputs.worker_version, inputs.latest_version,
                                                                    inputs.max_staleness):
        return Decision(0, "stale_adapter")
    if inputs.draining:
        return Decision(0, "draining")
    up_to_date = credit(inputs, inputs.latest_version)
    own = credit(inputs)
    limits = (
        ("limit", max(0, inputs.max_leases_per_worker - inputs.worker_leases)),
        ("backpressure", up_to_date),
        ("no_prompts", max(0, inputs.prompts_available)),
        ("stale_adapter", own),  # last: only when an up-to-date adapter would be granted more
    )
    granted, reason = inputs.requested, ""
    for name, allowed in limits:
        if allowed < granted:
            granted, reason = allowed, name
    return Decision(granted, reason)
