"""loraflow across hosts: a broker host, a learner on two hosts (torchrun, c10d rendezvous, gloo over the test
network), three worker hosts (w2 reaches the broker through a user-space relay on its host that adds latency and
cuts connections, bench/netproxy.py), CURVE on, every role started by deploy/scripts under ``ip netns exec`` (see
bench/netbed.py). One run trains through the faults in turn (one test each, in this order, so a failure names
its fault); each is checked as it recovers (the same processes carry on, the ledger so far has nothing trained
twice and no withdrawn version), and the last test stops the run and runs tests/fault's full audit.

The recovery times are printed (``-s``); bench/net_faults.py drives the same bed and records them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench import netbed
from tests.support import Processes

pytestmark = pytest.mark.net

NUM_PROMPTS = 520  # enough that every fault lands while the run trains (checked before each)
TOKENS_PER_S = 10  # simulated generation pace: workers ~3 groups/s each, the run a few steps per second


@pytest.fixture(scope="module")
def cluster(root_and_ip: None, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    root = tmp_path_factory.mktemp("net")
    c = netbed.Cluster(Processes(root), root, tiny_model_dir, num_prompts=NUM_PROMPTS, tokens_per_s=TOKENS_PER_S,
                       proxied=("w2",))
    try:
        c.setup()
        t0 = time.time()
        c.start()
        c.wait_steps(1, t0, 120, "the start")
        print(f"first step {time.time() - t0:.1f} s after start")
        yield c
    finally:
        c.teardown()


def _fault(c: netbed.Cluster, name: str, **kwargs) -> dict:
    started = time.monotonic()
    result = netbed.FAULTS[name](c, **kwargs)
    print(json.dumps(result), f"({time.monotonic() - started:.1f} s, {netbed.remaining(c)} prompts left)")
    return result


def test_bandwidth_limited(cluster: netbed.Cluster) -> None:
    r = _fault(cluster, "bandwidth_limited", w="w3", rate="1mbit", hold_s=6)
    probe = r["link_probe_s"]
    # 96 KB at 1 mbit takes >= 0.6 s (less the bucket's 16 KB burst); unlimited, a few ms
    assert probe["limited"] >= 0.5 and probe["limited"] > 10 * probe["normal"], f"the limit did not slow the link: {probe}"


def test_latency_and_resets(cluster: netbed.Cluster) -> None:
    r = _fault(cluster, "latency_and_resets", w="w2", delay_ms=100, hold_s=6, resets=2)
    assert r["median_ack_rtt_ms"]["delayed"] >= r["median_ack_rtt_ms"]["normal"] + 150, "the relay did not delay"


def test_worker_link_down(cluster: netbed.Cluster) -> None:
    r = _fault(cluster, "worker_link_down", w="w1", down_s=10)
    assert r["steps_while_down"] > 0, "the other workers should have kept the run training"


def test_broker_link_down(cluster: netbed.Cluster) -> None:
    _fault(cluster, "broker_link_down", down_s=10)


def test_broker_reboot(cluster: netbed.Cluster) -> None:
    r = _fault(cluster, "broker_reboot")
    assert r["processes_killed"] >= 1


def test_learner_node_killed(cluster: netbed.Cluster) -> None:
    r = _fault(cluster, "learner_node_killed", node="learner-1")
    assert r["exit_codes"]["learner-1"] == -9 and r["exit_codes"]["learner-0"] != 0, r["exit_codes"]


def test_audit_after_the_faults(cluster: netbed.Cluster) -> None:
    cluster.wait_all_trained(240)
    cluster.stop()
    audit = cluster.audit()
    print(audit.summary())
    assert len(audit.starts) == 2, "one learner restart (the killed node) and no other"
