"""The served-adapter evidence of agent groups (issue 14 through the gateway, :mod:`loraflow.rollout_worker.gateway`).

- an agent group's ``served`` is the engine's own report of the calls that generated its tokens (the
  ``GenOutput.served`` of every gateway chunk, seen by a spy on the real hf backend), and each recorded call
  keeps its report;
- an episode whose calls the engine served with another version's slot (a routing fault inside the hf engine)
  carries that slot's evidence, and the learner's evidence check (:func:`loraflow.learner.evidence.check_evidence`)
  fails the group, while the same episode served honestly passes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraflow.common.protocol import ServedAdapter
from loraflow.learner.evidence import LoraIds, check_evidence
from loraflow.learner.rescoring import AdapterHistory
from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.backends.base import Backend
from loraflow.rollout_worker.gateway.engine import GatewayEngine
from loraflow.rollout_worker.gateway.session import Session
from loraflow.rollout_worker.samples import FinishedGroup
from tests.worker import gateway_support
from tests.worker.helpers import Adapter, receive

CALCULATOR = "tests.worker.gateway_agents:calculator_text"  # several calls, tool results between them
ONE_CALL = "tests.worker.gateway_agents:one_call"  # only generated tokens: no context tokens to stamp


def play(backend: Backend, tiny_model_dir: Path, tmp_path: Path, group_id: str,
         agent: str = CALCULATOR) -> tuple[FinishedGroup, gateway_support.Spy]:
    """One group of three episodes through the gateway, and every engine output it took."""
    config = gateway_support.gateway_config(tiny_model_dir, tmp_path / group_id, agent)
    spy = gateway_support.Spy(backend)
    driver = gateway_support.Driver(config, backend)
    try:
        driver.add(gateway_support.lease(group_id, "3+4=", answer="7"))
        (group,) = driver.wait_groups(1)
    finally:
        driver.close()
        spy.close()
    return group, spy


def history_of(adapters: list[Adapter]) -> AdapterHistory:
    """What the learner published: v0 and the adapters' versions with their checksums."""
    history = AdapterHistory(torch.nn.Module(), keep=len(adapters) + 1, dtype=torch.float32)  # checksums only
    history.record(0, "")
    for adapter in adapters:
        history.record(adapter.update.version, adapter.update.sha256)
    return history


def versions_of(group: FinishedGroup) -> list[int]:
    return sorted(set(dict(group.tensors)["versions"].tolist()))


def test_an_agent_group_carries_the_engines_report_of_its_calls(
        tiny_model_dir: Path, hf_session_backend: Backend, adapters: list[Adapter], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    backend = hf_session_backend
    backend.retain(set())
    backend.add_adapter(receive(AdapterStore(tmp_path / "adapters"), adapters[0]))
    opened: list[Session] = []
    original = GatewayEngine.open

    def open_and_keep(self: GatewayEngine, session: Session) -> None:
        opened.append(session)
        original(self, session)

    monkeypatch.setattr(GatewayEngine, "open", open_and_keep)
    try:
        group, spy = play(backend, tiny_model_dir, tmp_path, "e0")
    finally:
        backend.retain(set())
    reports = [out.served for _, out in spy.seen]
    assert reports and all(r is not None and r.version == 1 for r in reports)
    assert versions_of(group) == [1]
    assert group.group.served == [reports[0]]
    (served,) = group.group.served
    assert (served.sha256, served.dtype) == (adapters[0].update.sha256, "float32") and served.lora_id > 0
    calls = [c for s in opened for c in s.calls]
    assert len(calls) == group.group.metrics["num_turns"] >= 3
    assert all(c.served == served for c in calls)
    assert check_evidence(versions_of(group), group.group.served, "w-test", history_of(adapters[:1]),
                          LoraIds()) is None


@pytest.mark.parametrize("agent", [ONE_CALL, CALCULATOR])
def test_an_episode_served_by_another_adapter_fails_the_learners_check(
        tiny_model_dir: Path, hf_session_backend: Backend, adapters: list[Adapter], tmp_path: Path,
        agent: str) -> None:
    """v2's requests routed to v1's slot inside the engine: the group claims v2, its evidence names v1's load
    (with one call per episode, only the engine's report of that call can say so)."""
    backend = hf_session_backend
    backend.retain(set())
    store = AdapterStore(tmp_path / "adapters")
    backend.add_adapter(receive(store, adapters[0]))
    backend.add_adapter(receive(store, adapters[1]))
    loaded_1, loaded_2 = backend.served(1), backend.served(2)
    slots = backend._slot_of  # type: ignore[attr-defined]
    meant = slots[2]
    slots[2] = slots[1]  # the fault, inside the engine, before the loop thread starts
    try:
        group, _ = play(backend, tiny_model_dir, tmp_path, "e1", agent)
    finally:
        slots[2] = meant
        backend.retain(set())
    assert versions_of(group) == [2]
    (served,) = group.group.served
    assert (served.version, served.lora_id, served.sha256) == (2, loaded_1.lora_id, adapters[0].update.sha256)
    assert served != loaded_2 and served != ServedAdapter(version=2)
    mismatch = check_evidence(versions_of(group), group.group.served, "w-test", history_of(adapters[:2]),
                              LoraIds())
    assert mismatch is not None and mismatch.reason == "adapter_sha256" and mismatch.version == 2, mismatch
