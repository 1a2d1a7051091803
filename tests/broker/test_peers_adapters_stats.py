"""The client registry, the adapter cache and the stats counters, on their own."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from loraflow.broker.adapters import AdapterCache
from loraflow.broker.peers import ClientIdTaken, PeerRegistry, RegistryFull
from loraflow.broker.stats import BrokerStats
from loraflow.common import codec
from loraflow.common.codes import ProtocolError
from loraflow.common.protocol import AdapterUpdate, Heartbeat, Hello


def registry(max_workers: int = 2) -> PeerRegistry:
    return PeerRegistry(heartbeat_interval_s=1.0, heartbeat_misses=3, max_workers=max_workers)


def hello(client_id: str, session: str = "s1", role: str = "worker", version: int = 0) -> Hello:
    return Hello(role=role, client_id=client_id, session=session, adapter_version=version)


@pytest.mark.parametrize("second, replaced, same_object", [
    (hello("a", "s1", version=3), False, True),  # the same process saying hello again
    (hello("a", "s2"), True, False),  # a restarted process: the old entry is handed back
    (hello("a", "s1", role="learner"), True, False),  # another role under the same identity
])
def test_hello_again(second: Hello, replaced: bool, same_object: bool) -> None:
    peers = registry()
    first, _ = peers.hello(b"worker/a", hello("a"), 0.0)
    peer, old = peers.hello(b"worker/a", second, 1.0)
    assert (old is first) is replaced and (peer is first) is same_object and len(peers) == 1
    if same_object:
        assert peer.adapter_version == 3 and peer.last_seen_s == 1.0


def test_another_connection_cannot_pose_as_a_registered_process() -> None:
    """With route tokens (CURVE) a process keeps its identity for its life: the same worker id and session from
    another identity, even under the same key, is refused (the learner trusts a process by that pair); a new
    session from another identity is a restart, as before."""
    peers = registry()
    first, _ = peers.hello(b"worker/a/t1", hello("a"), 0.0, key="worker:shared")
    with pytest.raises(ClientIdTaken, match="held by another connection"):
        peers.hello(b"worker/a/t2", hello("a"), 1.0, key="worker:shared")
    assert peers.worker("a", "s1") is first
    restarted, old = peers.hello(b"worker/a/t3", hello("a", "s2"), 2.0, key="worker:shared")
    assert old is first and restarted.session == "s2" and len(peers) == 1


def test_worker_limit_counts_workers_only() -> None:
    peers = registry(max_workers=1)
    peers.hello(b"worker/a", hello("a"), 0.0)
    peers.hello(b"learner/l", hello("l", role="learner"), 0.0)
    with pytest.raises(RegistryFull, match="broker.max_workers"):
        peers.hello(b"worker/b", hello("b"), 0.0)
    peers.hello(b"worker/a", hello("a", "s2"), 0.0)  # a restart of a known worker is not a new one


def test_death_after_missed_heartbeats() -> None:
    peers = registry()
    peers.hello(b"worker/a", hello("a"), 0.0)
    peers.hello(b"worker/b", hello("b"), 0.0)
    peers.heard(b"worker/b", 2.5)
    assert peers.dead(3.0) == []
    assert [p.client_id for p in peers.dead(3.1)] == ["a"]
    assert [p.client_id for p in peers.all()] == ["b"] and peers.heard(b"worker/a", 4.0) is None


def test_busy_share_from_reported_states() -> None:
    peers = registry()
    peer, _ = peers.hello(b"learner/l", hello("l", role="learner"), 0.0)
    assert peer.busy_share(0.0) is None
    peers.heartbeat(peer, Heartbeat(state="waiting"), 1.0)  # 1 s "starting" is not counted
    peers.heartbeat(peer, Heartbeat(state="training", counters={"steps": 2}), 2.0)
    assert peer.busy_share(5.0) == pytest.approx(3 / 4) and peer.counters == {"steps": 2}


def adapter(version: int, seed: int = 0, bad_digest: bool = False) -> tuple[AdapterUpdate, list, list]:
    tensors = [("lora_A", np.random.default_rng(seed).standard_normal(64, dtype=np.float32))]
    digest = "0" * 64 if bad_digest else hashlib.sha256(tensors[0][1].tobytes()).hexdigest()
    record = AdapterUpdate(version=version, sha256=digest, adapter_config={"r": 4})
    frames = codec.encode(record, tensors)
    _, envelope = codec.decode(frames)
    return record, envelope.specs, frames


def test_adapter_cache_keeps_the_newest() -> None:
    cache = AdapterCache(num_kept=2)
    assert cache.newest is None and cache.get(0) is None
    for version in (1, 2, 3):
        stored = cache.add(*adapter(version))
        assert stored.num_bytes == 256 and stored.notice().version == version
    assert [a["version"] for a in cache.snapshot()] == [2, 3]
    assert cache.get(0).version == 3 and cache.get(2).version == 2 and cache.get(1) is None
    with pytest.raises(ProtocolError, match="does not advance") as excinfo:
        cache.add(*adapter(3))
    assert excinfo.value.code == "stale_version"
    with pytest.raises(ProtocolError, match="sha256 of the tensor frames"):
        cache.add(*adapter(4, bad_digest=True))
    assert cache.newest.version == 3


def test_stats_counters_rates_and_prometheus() -> None:
    stats = BrokerStats(window_s=10.0)
    stats.tick(0.0)
    stats.count("messages_in", "hello", 3)
    stats.count("groups", "accepted", 20)
    stats.count("rejected", "malformed")
    stats.bytes_in += 5000
    stats.tokens_accepted += 400
    stats.tick(2.0)
    rates = stats.rates(2.0)
    assert rates["messages_in_per_s"] == 1.5 and rates["groups_per_s"] == 10 and rates["bytes_in_per_s"] == 2500
    snap = stats.snapshot(2.0)
    assert snap["rejected"] == {"malformed": 1} and snap["num_rejected"] == 1 and snap["group_events"]["accepted"] == 20
    text = stats.metrics.prometheus_text()
    assert 'loraflow_broker_groups_total{event="accepted"} 20' in text
    assert "loraflow_broker_bytes_in_total 5000" in text
    stats.count("groups", "accepted", 5)
    stats.tick(3.0)  # only the delta is pushed
    assert 'loraflow_broker_groups_total{event="accepted"} 25' in stats.metrics.prometheus_text()
