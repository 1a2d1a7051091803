"""The pieces the fault runs rely on, checked alone: the audit catches each violation it claims to catch, the
learner's own guard against withdrawn versions, and the ledger's newest-published lookup."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loraflow.common import codec
from loraflow.common.protocol import Batch, BatchEntry
from loraflow.learner import data
from loraflow.learner.ledger import Ledger, newest_published, read
from tests.fault.ledger import audit_learner
from tests.learner.scripted import make_group

pytestmark = pytest.mark.fault

IDS = {"0:0", "0:1", "0:2", "0:3"}


def start(step: int, checkpoint_version: int, next_version: int, withdrawn: list) -> dict[str, Any]:
    return {"event": "start", "step": step, "version": next_version - 1, "checkpoint_version": checkpoint_version,
            "next_version": next_version, "withdrawn": withdrawn}


def publish(version: int, step: int, sha: str = "") -> dict[str, Any]:
    return {"event": "publish", "version": version, "step": step, "sha256": sha or f"sha{version}"}


def step(n: int, trained: list[str], versions: list[int], trained_version: int, **kwargs: Any) -> dict[str, Any]:
    return {"event": "step", "step": n, "trained_version": trained_version, "trained": trained,
            "zero_variance": kwargs.get("zero_variance", []), "already_trained": kwargs.get("already_trained", []),
            "not_acked": [], "versions": {g: versions for g in trained}}


def good_ledger() -> list[dict[str, Any]]:
    """Two steps, a crash after step 2 (checkpoint at step 1), the resumed learner redoes step 2."""
    return [start(0, 0, 1, []),
            step(1, ["0:0", "0:1"], [0], 0), publish(1, 1),
            step(2, ["0:2", "0:3"], [1], 1), publish(2, 2),
            start(1, 1, 3, [[2, 2]]), publish(3, 1, sha="sha1"),
            step(2, ["0:3", "0:2"], [1, 3], 3), publish(4, 2)]


def test_a_sound_ledger_passes() -> None:
    audit = audit_learner(good_ledger(), IDS)
    assert [s["step"] for s in audit.chain] == [1, 2] and audit.steps_lost == 1 and audit.withdrawn == {2}


@pytest.mark.parametrize("change, message", [
    (lambda lines: lines.insert(8, step(3, ["0:0"], [3], 4)), "trained more than once"),
    (lambda lines: lines[7]["trained"].pop(), "never trained"),
    (lambda lines: lines[7]["versions"].update({"0:3": [2, 3]}), "withdrawn version(s) [2]"),
    (lambda lines: lines[6].update(version=2), "published after version 2"),
    (lambda lines: lines[6].update(sha256="other"), "should republish version 1's weights"),
    (lambda lines: lines[5].update(withdrawn=[]), "were published"),
    (lambda lines: lines[5].update(step=3), "a learner resumed at step 3"),
    (lambda lines: lines[7].update(already_trained=["0:2"]), "acknowledged as trained before"),
])
def test_each_violation_is_caught(change: Any, message: str) -> None:
    lines = good_ledger()
    change(lines)
    with pytest.raises(AssertionError, match=re.escape(message)):
        audit_learner(lines, IDS)


def test_learner_skips_groups_with_withdrawn_tokens() -> None:
    rng = np.random.default_rng(0)
    groups = [make_group(rng, f"0:{i}", group_size=4, min_version=v) for i, v in enumerate([3, 4, 5])]
    groups[1][1][3][1][-1] = 6  # one token of group 0:1 from version 6 (min 4, max 6 in the header)
    groups[1][0].max_version = 6
    entries, tensors = [], []
    for group, group_tensors in groups:
        entries.append(BatchEntry(group=group, first_tensor=len(tensors)))
        tensors.extend(group_tensors)
    batch, envelope = codec.decode(codec.encode(Batch(batch_id="b", groups=entries), tensors))
    selection = data.select_groups(batch, envelope.specs, envelope.frames, version=7, max_staleness=10,
                                   trained_group_ids=set(), vocab_size=259, withdrawn=[(5, 5)])
    # 0:1 spans versions 4..6 but holds no token of 5: kept; 0:2 was generated under 5: skipped, not acknowledged
    assert dict(selection.skipped) == {"withdrawn": 1} and selection.skipped_ids == {"withdrawn": ["0:2"]}
    assert "0:2" not in selection.ack_group_ids and selection.token_versions["0:1"] == [4, 6]


def test_ledger_lines_and_newest_published(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    assert newest_published(path) == 0
    ledger = Ledger(path)
    ledger.start(session="s", step=0, version=0, checkpoint_version=0, next_version=1, withdrawn=[])
    for version in range(1, 40):
        ledger.publish(version=version, step=version, sha256="x" * 64, num_bytes=1)
        ledger.step(step=version, batch_id="b", trained_version=version - 1, trained=["0:0"] * 50, zero_variance=[],
                    already_trained=[], not_acked=[], versions={})
    with open(path, "a") as f:
        f.write('{"event": "publish", "vers')  # torn by a kill
    assert newest_published(path) == 39
    assert newest_published(path, tail_bytes=100) == 39  # the tail holds no publish line: the whole file is read
    assert [line["event"] for line in read(path)][:3] == ["start", "publish", "step"]
