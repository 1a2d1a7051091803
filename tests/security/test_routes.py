"""Route tokens: under CURVE a client's identity ends in a random token. The broker still recognises a restarted
client by role and id (its old leases are reclaimed at once), and never shows the token to anyone."""

from __future__ import annotations

from loraflow.common.protocol import Hello, LeaseRequest
from tests.broker.harness import Harness

OLD, NEW = b"worker/w1/" + b"a" * 32, b"worker/w1/" + b"b" * 32


def test_a_restarted_client_under_a_new_route_replaces_the_old_one() -> None:
    h = Harness()
    h.send(OLD, Hello(role="worker", client_id="w1", session="first"))
    (_, grant, _), = h.send(OLD, LeaseRequest(max_leases=2))
    assert len(grant.leases) == 2
    stats = h.stats()
    assert [w["identity"] for w in stats["workers"]] == ["worker/w1"]
    assert {lease["worker"] for lease in stats["leases"]["list"]} == {"worker/w1"}

    h.send(NEW, Hello(role="worker", client_id="w1", session="second"))  # the same worker, restarted
    stats = h.stats()
    assert len(stats["workers"]) == 1 and stats["workers"][0]["session"] == "second"
    assert stats["leases"]["outstanding"] == 0 and stats["prompts"]["queued"] == 2
    assert stats["peers_gone"] == {"restarted": 1}
    (_, grant, _), = h.send(NEW, LeaseRequest(max_leases=2))
    assert [lease.group_id for lease in grant.leases] == ["0:0", "0:1"]
    assert b"a" * 32 not in repr(stats).encode() and b"b" * 32 not in repr(h.stats()).encode()
