"""An empty LeaseGrant backs the worker off only when asking again at once could not get more.

A worker whose lease request was answered ``stale_adapter`` just before the newest adapter arrived used to wait
EMPTY_GRANT_BACKOFF_S (200 ms) although its next request, carrying the new version, would be granted: once per
learner step in the demo (bench/time_to_accuracy.py's idle spans).
"""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest

from loraflow.common.protocol import LeaseGrant
from loraflow.rollout_worker.worker import EMPTY_GRANT_BACKOFF_S, Worker


class _Metrics:
    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def inc(self, name: str, **labels: str) -> None:
        key = (name, labels.get("reason", ""))
        self.counts[key] = self.counts.get(key, 0) + 1


def _worker(newest_version: int, *grants: LeaseGrant) -> SimpleNamespace:
    """Just what Worker._start_granted reads: the session's grant queue, the backend's newest version."""
    inbox: queue.Queue = queue.Queue()
    for grant in grants:
        inbox.put(grant)
    fake = SimpleNamespace(session=SimpleNamespace(grants=inbox), backend=SimpleNamespace(newest_version=newest_version),
                           metrics=_Metrics(), _next_request_at=0.0)
    fake._may_ask_again_now = lambda grant: Worker._may_ask_again_now(fake, grant)
    return fake


def _start(fake: SimpleNamespace) -> float:
    """Run the real _start_granted on the fake; the back-off it set, in seconds from now."""
    Worker._start_granted(fake)
    return fake._next_request_at - time.monotonic()


@pytest.mark.parametrize(("reason", "latest", "held", "backs_off"), [
    ("stale_adapter", 5, 5, False),  # the newest adapter is loaded now: ask with it at once
    ("stale_adapter", 5, 4, True),  # still fetching it: asking again now would be refused again
    ("backpressure", 5, 5, False),  # a long-poll that reached its deadline has waited in the broker already
    ("no_prompts", 5, 5, True),
    ("draining", 5, 5, True),
    ("limit", 5, 5, True),
    ("quarantined", 5, 5, True),
])
def test_an_empty_grant_backs_off_only_when_asking_again_cannot_help(reason, latest, held, backs_off):
    fake = _worker(held, LeaseGrant(leases=[], reason=reason, latest_version=latest))
    wait = _start(fake)
    if backs_off:
        assert EMPTY_GRANT_BACKOFF_S * 0.5 < wait <= EMPTY_GRANT_BACKOFF_S
    else:
        assert wait < 0
    assert fake.metrics.counts[("empty_grants", reason)] == 1  # counted either way


def test_loading_the_newest_adapter_ends_a_back_off():
    """A worker backing off after stale_adapter asks again as soon as its backend serves the new adapter."""
    adapter = SimpleNamespace(version=5, sha256="ab" * 32, num_bytes=1024)
    backend = SimpleNamespace(name="fake", newest_version=4, retain=lambda keep: None, load_phases_ms={})

    def add_adapter(new):
        backend.newest_version = new.version

    backend.add_adapter = add_adapter
    backend.served = lambda version: SimpleNamespace(lora_id=version, sha256=adapter.sha256)
    session = SimpleNamespace(take_adapter=lambda: adapter, set_adapter_version=lambda version: None)
    fake = SimpleNamespace(session=session, backend=backend, metrics=_Metrics(),
                           rollouts=SimpleNamespace(versions_in_use=lambda: set()),
                           store=SimpleNamespace(prune=lambda keep, upto_version: None),
                           _next_request_at=time.monotonic() + EMPTY_GRANT_BACKOFF_S)
    Worker._load_adapter(fake)
    assert backend.newest_version == 5
    assert fake._next_request_at == 0.0
