"""The served-adapter evidence a worker sends (``RolloutGroup.served``, :mod:`loraflow.common.integrity`), on real backends.

- a group generated across v0 -> v1 -> v2 carries one entry per version of its tokens: v0 the base entry, v1 and
  v2 with the published sha256 and distinct engine ids; it survives the wire;
- a version that appears only in environment tokens has its entry too;
- an adapter file swapped with another version's on disk before the backend loads it is reported with the other
  version's checksum, and a truncated one is refused or reported with another checksum: the evidence is what
  the engine loaded, not what the worker meant to load (which carries the published checksum);
- (hf) an engine that routes a version's requests to another version's slot reports that slot's load;
- the agent gateway's groups carry the evidence of their versions too.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from loraflow.common import codec
from loraflow.common.config import WorkerConfig
from loraflow.common.protocol import ServedAdapter
from loraflow.rollout_worker.adapters import WEIGHTS_FILE, AdapterStore
from loraflow.rollout_worker.backends.base import Backend, GenRequest
from loraflow.rollout_worker.envs import Environment, EnvResolver, Episode, Step
from loraflow.rollout_worker.rollout import Rollouts
from loraflow.rollout_worker.samples import FinishedGroup
from tests.support import wait_for
from tests.worker import gateway_support
from tests.worker.helpers import Adapter, lease, receive

PROMPT = "12+34="


def finish(rollouts: Rollouts) -> FinishedGroup:
    finished: list[FinishedGroup] = []

    def advance() -> bool:
        finished.extend(rollouts.step() or rollouts.poll())
        return bool(finished)

    wait_for(advance, 120, "the group to finish", interval_s=0.005)
    (group,) = finished
    return group


def test_a_group_across_two_swaps_carries_the_evidence_of_each_version(backend: Backend, store: AdapterStore,
                                                                       adapters: list[Adapter]) -> None:
    config = WorkerConfig(chunk_tokens=3, max_new_tokens=9, partial_policy="continue")
    rollouts = Rollouts(backend, EnvResolver(), config, worker_id="w", max_seq_len=256, greedy=True)
    rollouts.add(lease("7:1", prompt=PROMPT, group_size=2))
    samples = rollouts.groups["lease-7:1"].samples

    def generate_under(version: int) -> None:  # a chunk; streaming, engine steps until a token of it
        while not all(version in s.versions for s in samples):
            assert rollouts.step() == []

    generate_under(0)
    backend.add_adapter(receive(store, adapters[0]))
    generate_under(1)
    backend.add_adapter(receive(store, adapters[1]))
    finished = finish(rollouts)  # the rest under v2

    versions = sorted(set(dict(finished.tensors)["versions"].tolist()))
    assert versions == [0, 1, 2]
    served = finished.group.served
    assert [s.version for s in served] == versions
    assert served[0] == ServedAdapter(version=0, dtype="float32")
    assert [s.sha256 for s in served[1:]] == [adapters[0].update.sha256, adapters[1].update.sha256]
    assert len({s.lora_id for s in served}) == 3 and all(s.lora_id > 0 for s in served[1:])
    assert all(s.adapter for s in served[1:]) and served[1].adapter != served[2].adapter
    assert {s.dtype for s in served} == {"float32"}
    record, _ = codec.decode([bytes(f) for f in codec.encode(finished.group, finished.tensors)])
    assert record.served == served


class ReplyOnce(Environment):
    """Replies to the first model turn once ``release`` is set; the episode ends after the second."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def start(self, episode: Episode) -> Any:
        return {"turns": 0}

    def step(self, state: Any, turn: str, *, finished: bool, episode: Episode) -> Step:
        if not self.release.wait(60):
            raise TimeoutError("never released")
        state["turns"] += 1
        return Step(done=False, reply=" ok") if state["turns"] == 1 else Step(done=True)


@pytest.mark.parametrize("backend", ["hf"], indirect=True)
def test_a_version_only_in_environment_tokens_has_its_entry(backend: Backend, store: AdapterStore,
                                                          adapters: list[Adapter]) -> None:
    """``finish`` keeps the sample on v1; the reply arriving after v2 loaded is stamped v2."""
    env = ReplyOnce()
    config = WorkerConfig(chunk_tokens=4, max_new_tokens=4, max_turns=2, partial_policy="finish")
    rollouts = Rollouts(backend, EnvResolver(env), config, worker_id="w", max_seq_len=256, greedy=True)
    backend.add_adapter(receive(store, adapters[0]))
    rollouts.add(lease("7:2", prompt=PROMPT, group_size=1))
    assert rollouts.step() == []  # the first turn under v1; its environment step waits
    backend.add_adapter(receive(store, adapters[1]))
    env.release.set()
    finished = finish(rollouts)

    arrays = dict(finished.tensors)
    generated = {v for v, m in zip(arrays["versions"].tolist(), arrays["loss_mask"].tolist(), strict=True) if m}
    assert generated == {1} and sorted(set(arrays["versions"].tolist())) == [1, 2]
    assert [(s.version, s.sha256) for s in finished.group.served] == [(1, adapters[0].update.sha256),
                                                                      (2, adapters[1].update.sha256)]


def test_a_swapped_adapter_file_is_reported_with_the_checksum_of_what_was_loaded(
        backend: Backend, store: AdapterStore, adapters: list[Adapter]) -> None:
    first, second = receive(store, adapters[0]), receive(store, adapters[1])
    shutil.copyfile(first.path / WEIGHTS_FILE, second.path / WEIGHTS_FILE)  # v2's file now holds v1's tensors
    assert second.sha256 == adapters[1].update.sha256  # what the worker means to load
    backend.add_adapter(second)
    served = backend.served(2)
    assert served.sha256 == adapters[0].update.sha256 != adapters[1].update.sha256
    (output,) = backend.generate([GenRequest(token_ids=backend.encode(PROMPT), max_tokens=2, version=2)],
                                 greedy=True)
    assert output.served == served


@pytest.mark.parametrize("backend", ["hf", "sim"], indirect=True)
def test_a_truncated_adapter_file_is_refused_or_reported_with_another_checksum(
        backend: Backend, store: AdapterStore, adapters: list[Adapter]) -> None:
    received = receive(store, adapters[1], version=5)
    path: Path = received.path / WEIGHTS_FILE
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    try:
        backend.add_adapter(received)
    except Exception:  # noqa: BLE001 - safetensors' own error type, or our ValueError: either is a refusal
        assert not backend.has_version(5)
        return
    assert backend.served(5).sha256 != adapters[1].update.sha256


@pytest.mark.parametrize("backend", ["hf"], indirect=True)
def test_hf_reports_the_slot_its_layers_serve_not_the_one_meant(backend: Backend, store: AdapterStore,
                                                               adapters: list[Adapter]) -> None:
    """A routing fault (v2's requests served by v1's slot) shows in the report and stays in the evidence."""
    backend.add_adapter(receive(store, adapters[0]))
    backend.add_adapter(receive(store, adapters[1]))
    loaded_1, loaded_2 = backend.served(1), backend.served(2)
    assert loaded_2.sha256 == adapters[1].update.sha256
    slots = backend._slot_of  # type: ignore[attr-defined]
    meant = slots[2]
    slots[2] = slots[1]  # the fault, inside the engine
    try:
        (output,) = backend.generate([GenRequest(token_ids=backend.encode(PROMPT), max_tokens=2, version=2)],
                                     greedy=True)
    finally:
        slots[2] = meant
    assert output.served is not None
    assert (output.served.version, output.served.lora_id, output.served.sha256) == \
        (2, loaded_1.lora_id, adapters[0].update.sha256)
    assert backend.served(2) == output.served != loaded_2


def test_gateway_groups_carry_the_evidence_of_their_versions(tiny_model_dir: Path, hf_session_backend: Backend,
                                                             adapters: list[Adapter], tmp_path: Path) -> None:
    backend = hf_session_backend
    backend.retain(set())
    config = gateway_support.gateway_config(tiny_model_dir, tmp_path, "tests.worker.gateway_agents:calculator_text")
    driver = gateway_support.Driver(config, backend)
    try:
        driver.add(gateway_support.lease("g0", "3+4=", answer="7"))
        driver.wait_groups(1)
        driver.add_adapter(receive(AdapterStore(tmp_path / "adapters"), adapters[0]))
        driver.add(gateway_support.lease("g1", "5+6=", answer="11"))
        base, tuned = (g.group for g in driver.wait_groups(2))
    finally:
        driver.close()
        backend.retain(set())
    assert base.served == [ServedAdapter(version=0, dtype="float32")]
    (served,) = tuned.served
    assert (served.version, served.sha256) == (1, adapters[0].update.sha256) and served.lora_id > 0


def test_a_bf16_hf_engine_holding_an_fp32_adapter_reports_the_published_checksum(
        tiny_model_dir: Path, store: AdapterStore, adapters: list[Adapter]) -> None:
    """A narrower engine rounds the adapter on the copy; holding the published weights as it rounds them is a
    faithful load (else every group of a bf16 hf worker under an fp32 learner would fail the check)."""
    from loraflow.rollout_worker.backends.base import Sampling
    from loraflow.rollout_worker.backends.hf import HfBackend

    engine = HfBackend(tiny_model_dir, sampling=Sampling(), device="cpu", dtype="bfloat16", seed=0)
    engine.add_adapter(receive(store, adapters[0]))
    served = engine.served(1)
    assert served.sha256 == adapters[0].update.sha256 and served.dtype == "bfloat16", served


def _reordered(adapter: Adapter, order: list[str], state: dict[str, Any] | None = None) -> Adapter:
    """The same adapter published with its tensors in ``order`` (and, given ``state``, other values)."""
    from dataclasses import replace as replace_field

    from msgspec.structs import replace as replace_record

    from loraflow.common.framing import frames_sha256

    state = state if state is not None else adapter.state
    tensors = [(name, state[name]) for name in order]
    sha = frames_sha256(codec.encode(adapter.update, tensors)[2:])
    update = replace_record(adapter.update, sha256=sha)
    _, envelope = codec.decode([bytes(f) for f in codec.encode(update, tensors)])
    return replace_field(adapter, update=update, envelope=envelope, state=dict(tensors))


@pytest.mark.parametrize("backend", ["hf"], indirect=True)
def test_hf_slots_are_one_buffer_laid_out_in_the_files_order(backend: Backend, store: AdapterStore,
                                                             adapters: list[Adapter], reference: Any) -> None:
    """(hf) A slot's LoRA parameters are views of one buffer (a load is one copy in and one read back); a file
    ordering its tensors otherwise is laid out again, and serves exactly its weights."""
    import torch

    first = adapters[0]
    backend.add_adapter(receive(store, first))
    slot = backend._slot_of[1]  # type: ignore[attr-defined]
    layout = backend._layouts[slot]  # type: ignore[attr-defined]
    params = backend._parameters_of(slot)  # type: ignore[attr-defined]
    start, end = layout.flat.data_ptr(), layout.flat.data_ptr() + layout.flat.numel() * layout.flat.element_size()
    assert all(start <= p.data_ptr() < end for p in params.values()) and len(params) == len(first.state)
    backend.retain(set())  # every slot is free again, each laid out in the published order
    reversed_order = _reordered(adapters[1], list(reversed(adapters[1].state)))
    backend.add_adapter(receive(store, reversed_order, version=2))
    again = backend._slot_of[2]  # type: ignore[attr-defined]  # a free slot, laid out in the published order
    assert backend._layouts[again].names == list(reversed(first.state))  # type: ignore[attr-defined]
    assert backend.served(2).sha256 == reversed_order.update.sha256
    prompt = backend.encode(PROMPT)
    (output,) = backend.generate([GenRequest(token_ids=prompt, max_tokens=6, version=2)], greedy=True)
    eos = backend.eos_token_ids[0]
    assert output.token_ids == reference.greedy(adapters[1], prompt, 6, eos)[:len(output.token_ids)]
    torch.testing.assert_close(torch.tensor(output.logprobs),
                               torch.tensor(reference.logprobs(adapters[1], prompt, output.token_ids)))


@pytest.mark.parametrize("backend", ["hf"], indirect=True)
def test_hf_refuses_an_adapter_file_not_packed_in_one_dtype_and_frees_the_slot(
        backend: Backend, store: AdapterStore, adapters: list[Adapter]) -> None:
    """(hf) A file whose tensors are of two dtypes does not fit a slot: refused with the reason, and the slot it
    was offered is free for the next version."""
    import torch

    first = adapters[0]
    names = list(first.state)
    mixed = {n: (t.to(torch.bfloat16) if i == 0 else t) for i, (n, t) in enumerate(first.state.items())}
    with pytest.raises(ValueError, match="does not fit the model"):
        backend.add_adapter(receive(store, _reordered(first, names, mixed), version=1))
    assert not backend.has_version(1)
    backend.add_adapter(receive(store, adapters[1], version=2))
    assert backend.served(2).sha256 == adapters[1].update.sha256
