"""The staleness rule on the broker: a group is kept while its newest token is within max_staleness (issue 13).

A sample of ``worker.partial_policy = "continue"`` spans versions; judged by its oldest token (the rule before,
``StalenessRule.OLDEST_TOKEN``) the longest completions were the ones dropped. Here each judgement of a group
spanning versions is checked on the in-process core (real encoded messages), under both rules.
"""

from __future__ import annotations

import numpy as np
import pytest

from loraflow.broker.buffer import RolloutBuffer, StoredGroup
from loraflow.common import versions
from loraflow.common.protocol import Batch, BatchRequest, PromptLease
from loraflow.common.versions import StalenessRule
from tests.broker.clients import make_group
from tests.broker.harness import LEARNER, W1, Harness


@pytest.fixture
def h() -> Harness:
    harness = Harness()  # max_staleness 1, group_size 2, groups_per_step 2
    harness.hello(W1)
    harness.hello(LEARNER)
    return harness


def spanning_group(lease: PromptLease, first: int, last: int) -> tuple:
    """A group whose samples' first half of tokens are of version ``first``, the rest of ``last``."""
    record, tensors = make_group(lease, "w1", completion_len=6)
    token_versions = np.array(([first] * 3 + [last] * 3) * lease.group_size, dtype=np.int32)
    tensors = [(name, token_versions if name == "versions" else array) for name, array in tensors]
    record.min_version, record.max_version = first, last
    return record, tensors


@pytest.mark.parametrize("latest, min_version, max_version, max_staleness, newest_rule, oldest_rule", [
    (5, 5, 5, 0, False, False),
    (5, 4, 5, 0, False, True),   # a sample that spans a swap: kept, its v4 tokens masked
    (5, 2, 4, 1, False, True),
    (5, 2, 3, 1, True, True),    # no token within the bound: dropped whole under either rule
    (5, 4, 4, 1, False, False),
])
def test_which_token_decides(latest: int, min_version: int, max_version: int, max_staleness: int,
                             newest_rule: bool, oldest_rule: bool) -> None:
    assert versions.group_is_too_stale(latest, min_version, max_version, max_staleness) is newest_rule
    assert versions.group_is_too_stale(latest, min_version, max_version, max_staleness,
                                       StalenessRule.OLDEST_TOKEN) is oldest_rule


def test_stale_tokens_are_those_older_than_the_bound() -> None:
    token_versions = np.array([2, 3, 4, 5, 5])
    assert versions.oldest_trainable(5, 2) == 3
    assert versions.stale_tokens(token_versions, 5, 2).tolist() == [True, False, False, False, False]
    assert not versions.stale_tokens(token_versions, 5, 3).any()


def publish_to(h: Harness, version: int) -> None:
    for v in range(h.core.latest_version + 1, version + 1):
        assert h.publish(v).KIND.name == "ACK"


@pytest.mark.parametrize("rule, accepted", [(StalenessRule.NEWEST_TOKEN, True), (StalenessRule.OLDEST_TOKEN, False)])
def test_a_group_spanning_versions_on_arrival(h: Harness, rule: StalenessRule, accepted: bool) -> None:
    h.core.ledger.staleness_rule = rule
    lease, = h.lease(W1)
    publish_to(h, 2)
    record, tensors = spanning_group(lease, 0, 2)  # v0 tokens are 2 behind, the bound is 1; v2 ones are fresh
    reply = h.reply_to(W1, h.send(W1, record, tensors))
    if accepted:
        assert reply.status == "accepted" and h.stats()["buffer"]["groups"] == 1
    else:
        assert reply.code == "invalid_group" and "min_version 0" in reply.message
        assert h.stats()["dropped"] == {"stale_on_arrival": 1} and h.stats()["prompts"]["queued"] == 1


def test_a_group_with_no_token_within_the_bound_is_refused_on_arrival(h: Harness) -> None:
    lease, = h.lease(W1)
    publish_to(h, 3)
    record, tensors = spanning_group(lease, 0, 1)
    reply = h.reply_to(W1, h.send(W1, record, tensors))
    assert reply.code == "invalid_group" and "max_version 1 is more than max_staleness 1 behind version 3" \
        in reply.message
    assert h.stats()["dropped"] == {"stale_on_arrival": 1} and h.stats()["rejected"] == {"stale": 1}


@pytest.mark.parametrize("rule", list(StalenessRule))
def test_buffered_groups_age_by_their_newest_token(h: Harness, rule: StalenessRule) -> None:
    """Two groups buffered at version 1: one of v1 tokens only, one spanning v0..v1. At version 2 the spanning
    one is kept under the newest-token rule (served; its v0 tokens are the learner's to mask), dropped under the
    oldest-token rule (its prompt re-queued)."""
    h.core.ledger.staleness_rule = rule
    leases = h.lease(W1, 2)
    publish_to(h, 1)
    for lease, first in zip(leases, (1, 0), strict=True):
        assert h.reply_to(W1, h.send(W1, *spanning_group(lease, first, 1))).status == "accepted"
    publish_to(h, 2)
    newest = rule is StalenessRule.NEWEST_TOKEN
    replies = h.send(LEARNER, BatchRequest(num_groups=2 if newest else 1, wait_ms=0))
    batch, = [r for i, r, _ in replies if i == LEARNER and isinstance(r, Batch)]
    served = [(e.group.group_id, e.group.min_version) for e in batch.groups]
    if newest:
        assert served == [("0:0", 1), ("0:1", 0)] and not h.stats()["dropped"]
    else:
        assert served == [("0:0", 1)] and h.stats()["dropped"] == {"stale": 1}
        assert h.stats()["prompts"]["queued"] == 1


def stored(index: int, min_version: int, max_version: int) -> StoredGroup:
    return StoredGroup(group_id=f"0:{index}", key=(0, index), header={}, wire_specs=[], frames=[b"x"], num_bytes=1,
                       min_version=min_version, max_version=max_version)


def test_buffer_drop_stale_under_each_rule() -> None:
    groups = [(0, 0), (0, 2), (2, 2), (1, 3)]
    for rule, kept in ((StalenessRule.NEWEST_TOKEN, ["0:1", "0:2", "0:3"]), (StalenessRule.OLDEST_TOKEN, ["0:2"])):
        buffer = RolloutBuffer(max_groups=10, max_bytes=100, group_overhead_bytes=0)
        for i, (lo, hi) in enumerate(groups):
            buffer.add(stored(i, lo, hi))
        buffer.drop_stale(latest_version=3, max_staleness=1, rule=rule)
        assert [g.group_id for g in buffer.buffered()] == kept
    assert stored(9, 4, -1).max_version == 4  # a group made with min_version only: one version
