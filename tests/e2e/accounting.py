"""Reads a finished run directory back: what the learner trained, what the broker still owes, per step."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from loraflow.deploy import rundir


@dataclass
class RunRecord:
    steps: list[dict]
    trained_ids: set[str]  # from the learner's final checkpoint
    pending_ids: set[str]  # issued but not trained, from the broker's final state
    cursor: tuple[int, int]
    broker_trained: int

    @property
    def issued_ids(self) -> set[str]:
        epoch, index = self.cursor
        assert epoch == 0, "these runs never finish an epoch"
        return {f"0:{i}" for i in range(index)}


def read_run(run_dir: Path) -> RunRecord:
    checkpoints = sorted((run_dir / "learner" / "checkpoints").glob("step_*/learner_state.json"))
    assert checkpoints, f"no learner checkpoint in {run_dir}"
    learner_state = json.loads(checkpoints[-1].read_text())
    broker_state = json.loads((run_dir / "broker" / "state.json").read_text())
    return RunRecord(steps=rundir.read_jsonl(rundir.metrics_path(run_dir)),
                     trained_ids=set(learner_state["trained_group_ids"]),
                     pending_ids={f"{e}:{i}" for e, i in broker_state["pending"]},
                     cursor=tuple(broker_state["cursor"]), broker_trained=broker_state["num_trained_groups"])


def check_exactly_once(record: RunRecord) -> None:
    """Every issued prompt is trained once or still owed by the broker; none acknowledged twice."""
    assert not record.trained_ids & record.pending_ids, "trained prompts are still pending at the broker"
    lost = record.issued_ids - record.trained_ids - record.pending_ids
    assert not lost, f"prompts issued but neither trained nor pending: {sorted(lost)[:10]}"
    assert record.broker_trained == len(record.trained_ids)
    not_acked = ("stale", "invalid", "withdrawn")
    acked = sum(s["num_groups"] - sum(s["skipped"].get(r, 0) for r in not_acked) for s in record.steps)
    assert sum(s["skipped"].get("already_trained", 0) for s in record.steps) == 0, "a group was served again"
    assert acked == len(record.trained_ids), f"{acked} groups acknowledged, {len(record.trained_ids)} distinct"


def check_steps(record: RunRecord, *, max_staleness: int, num_steps: int) -> None:
    steps = record.steps
    assert [s["step"] for s in steps] == list(range(1, num_steps + 1))
    versions = [s["version"] for s in steps]
    assert versions == sorted(set(versions)) and versions[-1] >= num_steps, f"versions did not advance: {versions}"
    assert all(math.isfinite(s["reward_mean"]) and math.isfinite(s["loss"]) for s in steps)
    staleness = {int(k) for s in steps for k, n in s["staleness"].items() if n}
    assert staleness and max(staleness) <= max_staleness, f"trained staleness {sorted(staleness)}"
    assert sum(s["num_groups_trained"] for s in steps) > 0, "no group had reward variance: nothing was trained"
