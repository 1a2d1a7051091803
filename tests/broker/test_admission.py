"""Credit-based admission: the grant size and the reason for each limit, table-driven and as properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.broker.admission import AdmissionInputs, credit, decide
from loraflow.common import versions

BASE = AdmissionInputs(requested=4, worker_version=0, latest_version=0, max_staleness=1, groups_per_step=4,
                       capacity_groups=8, num_leased=0, num_stored=0, num_trained_groups=0, base_version=0,
                       worker_leases=0, max_leases_per_worker=16, stored_bytes=0, mean_group_bytes=0.0,
                       max_buffer_bytes=1 << 20, prompts_available=4)


@pytest.mark.parametrize("changes, granted, reason", [
    ({}, 4, ""),
    ({"requested": 10, "prompts_available": 10}, 8, "backpressure"),  # capacity 8
    ({"num_leased": 3, "num_stored": 3}, 2, "backpressure"),
    ({"num_stored": 8}, 0, "backpressure"),
    ({"worker_version": 0, "latest_version": 2}, 0, "stale_adapter"),  # 2 behind, bound 1
    ({"worker_version": 1, "latest_version": 2}, 4, ""),
    ({"draining": True}, 0, "draining"),
    ({"worker_leases": 14}, 2, "limit"),
    ({"prompts_available": 1}, 1, "no_prompts"),
    ({"prompts_available": 0}, 0, "no_prompts"),
    # admission limit: (max_staleness + 1 + versions done) x groups_per_step - trained
    ({"capacity_groups": 100, "requested": 20, "prompts_available": 20}, 8, "backpressure"),
    ({"capacity_groups": 100, "requested": 20, "prompts_available": 20, "latest_version": 1,
      "worker_version": 1, "num_trained_groups": 4}, 8, "backpressure"),
    ({"capacity_groups": 100, "requested": 20, "prompts_available": 20, "num_trained_groups": 4}, 4, "backpressure"),
    ({"capacity_groups": 100, "requested": 20, "prompts_available": 20, "latest_version": 5, "worker_version": 5,
      "base_version": 5}, 8, "backpressure"),  # counting restarts at the broker's base version
    # ... taken at the worker's version: a group made with v0 queues behind what is in flight
    ({"capacity_groups": 100, "requested": 20, "prompts_available": 20, "latest_version": 1,
      "worker_version": 0, "num_trained_groups": 4}, 4, "stale_adapter"),  # v1 would get 8
    ({"capacity_groups": 100, "requested": 20, "prompts_available": 20, "latest_version": 1,
      "worker_version": 0, "num_trained_groups": 4, "num_stored": 4}, 0, "stale_adapter"),
    ({"latest_version": 1, "worker_version": 0, "num_stored": 8}, 0, "backpressure"),  # full either way
    # byte bound projected from the mean group size
    ({"mean_group_bytes": 300_000.0}, 3, "backpressure"),
    ({"mean_group_bytes": 300_000.0, "num_leased": 1, "stored_bytes": 300_000}, 1, "backpressure"),
    ({"mean_group_bytes": 4_000_000.0}, 1, "backpressure"),  # one always fits an empty buffer
    ({"mean_group_bytes": 4_000_000.0, "num_leased": 1}, 0, "backpressure"),
])
def test_decide(changes: dict, granted: int, reason: str) -> None:
    decision = decide(dataclasses.replace(BASE, **changes))
    assert (decision.num_leases, decision.reason) == (granted, reason)


def test_tightest_limit_names_the_reason() -> None:
    decision = decide(dataclasses.replace(BASE, worker_leases=15, prompts_available=0))
    assert (decision.num_leases, decision.reason) == (0, "no_prompts")
    decision = decide(dataclasses.replace(BASE, worker_leases=16, prompts_available=0))
    assert (decision.num_leases, decision.reason) == (0, "limit")  # a tie: the earlier limit


@settings(max_examples=300, deadline=None)
@given(requested=st.integers(1, 64), worker_version=st.integers(0, 6), latest=st.integers(0, 6),
       max_staleness=st.integers(0, 3), groups_per_step=st.integers(1, 8), capacity=st.integers(1, 64),
       leased=st.integers(0, 40), stored=st.integers(0, 40), trained=st.integers(0, 60),
       worker_leases=st.integers(0, 20), per_worker=st.integers(1, 20), mean=st.sampled_from([0.0, 100.0, 5000.0]),
       stored_bytes=st.integers(0, 50_000), available=st.integers(0, 64))
def test_grants_never_break_a_bound(requested: int, worker_version: int, latest: int, max_staleness: int,
                                    groups_per_step: int, capacity: int, leased: int, stored: int, trained: int,
                                    worker_leases: int, per_worker: int, mean: float, stored_bytes: int,
                                    available: int) -> None:
    inputs = AdmissionInputs(requested=requested, worker_version=worker_version, latest_version=latest,
                             max_staleness=max_staleness, groups_per_step=groups_per_step, capacity_groups=capacity,
                             num_leased=leased, num_stored=stored, num_trained_groups=trained, base_version=0,
                             worker_leases=worker_leases, max_leases_per_worker=per_worker,
                             stored_bytes=stored_bytes, mean_group_bytes=mean, max_buffer_bytes=20_000,
                             prompts_available=min(available, requested))
    decision = decide(inputs)
    n = decision.num_leases
    assert 0 <= n <= requested
    assert (decision.reason == "") == (n == requested)
    if n:
        assert versions.worker_may_generate(worker_version, latest, max_staleness)
        in_flight = leased + stored + n
        assert in_flight <= capacity
        assert in_flight <= versions.admission_limit(latest, max_staleness, groups_per_step, trained)
        assert worker_leases + n <= per_worker
        assert n <= available
        if mean and leased + stored:
            assert stored_bytes + (leased + n) * mean <= 20_000
    assert credit(inputs) >= 0
