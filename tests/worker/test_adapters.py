"""Received adapters: checksum verified, written as PEFT directories that peft and safetensors load, pruned."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from msgspec.structs import replace
from safetensors.torch import load_file

from loraflow.common import codec
from loraflow.common.framing import frames_sha256
from loraflow.rollout_worker.adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterRejected, AdapterStore
from tests.worker.helpers import Adapter, Reference, make_adapter, receive


def test_received_adapter_is_a_peft_directory_with_identical_weights(store: AdapterStore, adapters: list[Adapter],
                                                                     reference: Reference) -> None:
    adapter = adapters[0]
    received = receive(store, adapter)
    assert received.path.name == "v000001" and received.version == 1
    assert json.loads((received.path / CONFIG_FILE).read_text()) == adapter.config
    loaded = load_file(str(received.path / WEIGHTS_FILE))
    assert list(loaded) == list(adapter.state)
    for name, tensor in adapter.state.items():
        assert torch.equal(loaded[name], tensor)
    assert received.num_bytes == sum(t.numel() * t.element_size() for t in adapter.state.values())

    from peft import PeftModel  # the directory loads as a normal PEFT adapter, with the same logits
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(reference.model_dir)),
                                      str(received.path)).eval()
    ids = torch.tensor([[16, 17, 10, 18, 19, 28]])
    with torch.inference_mode():
        assert torch.allclose(model(ids).logits, reference.model(adapter)(ids).logits, atol=1e-5)


def test_bf16_adapter_is_written_bit_exact(store: AdapterStore, tiny_model_dir: Path) -> None:
    adapter = make_adapter(tiny_model_dir, version=7, seed=7, rank=4, dtype=torch.bfloat16,
                           target_modules=("q_proj", "v_proj"))
    loaded = load_file(str(receive(store, adapter).path / WEIGHTS_FILE))
    for name, tensor in adapter.state.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name].view(torch.int16), tensor.view(torch.int16))


def test_corrupted_or_mislabelled_adapters_are_rejected(store: AdapterStore, adapters: list[Adapter]) -> None:
    adapter = adapters[0]
    frames = [bytes(f) for f in adapter.frames]
    frames[2] = bytes([frames[2][0] ^ 1]) + frames[2][1:]  # one flipped bit in the first tensor
    record, envelope = codec.decode(frames)
    with pytest.raises(AdapterRejected) as caught:
        store.receive(record, envelope.specs, envelope.frames)
    assert caught.value.reason == "sha256"
    not_lora = replace(adapter.update, adapter_config={**adapter.config, "peft_type": "PREFIX_TUNING"})
    with pytest.raises(AdapterRejected) as caught:
        store.receive(not_lora, adapter.envelope.specs, adapter.envelope.frames)
    assert caught.value.reason == "config"
    assert not any(store.directory.iterdir())  # nothing written for a rejected adapter


def test_same_version_again_is_kept_and_new_weights_replace_it(store: AdapterStore, adapters: list[Adapter]) -> None:
    first = receive(store, adapters[0])
    assert receive(store, adapters[0]) is first
    replaced = receive(store, adapters[1], version=1)  # version 1 re-published with other weights
    assert replaced.sha256 == adapters[1].update.sha256 != first.sha256
    loaded = load_file(str(replaced.path / WEIGHTS_FILE))
    assert all(torch.equal(loaded[k], v) for k, v in adapters[1].state.items())
    assert [p.name for p in store.directory.iterdir()] == ["v000001"]


def test_prune_keeps_the_retained_and_any_newer_version(store: AdapterStore, adapters: list[Adapter]) -> None:
    for version in (1, 2, 3, 4):
        receive(store, adapters[version - 1])
    assert store.prune({2}, upto_version=3) == [1, 3]
    assert sorted(p.name for p in store.directory.iterdir()) == ["v000002", "v000004"]
    assert sorted(store.adapters) == [2, 4]


def test_checksum_is_over_tensor_bytes_in_order() -> None:
    a, b = b"\x01\x02", b"\x03"
    assert frames_sha256([a, b]) != frames_sha256([b, a])
    assert frames_sha256([a, b]) == hashlib.sha256(a + b).hexdigest()
