"""The hf backend's KV cache across chunks (rollout_worker/backends/hf_decode.py) against the reference path.

The reference is the same backend with ``kv_cache=False``: transformers' ``generate`` over the whole sequence
every chunk. Both are driven through the same scripted rounds (several chunks per sample, rows of different
lengths, an end-of-turn id that ends one row early, tokens appended between chunks as an environment reply
would be, a swap to a new adapter version mid-sample, a version re-published with other weights) with the same
seed; tokens must be equal one for one and log-probs within 1e-5 (fp32, the tiny model), greedy and sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.backends import hf_decode
from loraflow.rollout_worker.backends.base import GenRequest, Sampling
from loraflow.rollout_worker.backends.hf import HfBackend
from tests.worker.helpers import Adapter, receive

PROMPTS = ["12+34=", "7+8=", "99+1=", "a much longer prompt: 123456789"]


@dataclass
class Trace:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    finished: dict[str, bool] = field(default_factory=dict)


def drive(backend: HfBackend, store: AdapterStore, adapters: list[Adapter], *, greedy: bool,
          stop_id: int | None = None) -> Trace:
    """Six rounds of chunks over four samples; v1 from the start, v2 arrives after round 2 (samples 0, 1 move to
    it: ``continue``), v1 is re-published with other weights after round 4 (sample 2 stays on v1)."""
    backend.add_adapter(receive(store, adapters[0], version=1))
    torch.manual_seed(11)
    prompts = [backend.encode(p) for p in PROMPTS]
    sequences = {f"s{i}": list(p) for i, p in enumerate(prompts)}
    versions = {"s0": 1, "s1": 1, "s2": 1, "s3": 0}
    trace = Trace(tokens={k: [] for k in sequences}, logprobs={k: [] for k in sequences})
    for round_index in range(6):
        if round_index == 2:
            backend.add_adapter(receive(store, adapters[1], version=2))
            versions.update(s0=2, s1=2)
        if round_index == 4:
            backend.add_adapter(receive(store, adapters[2], version=1))  # v1 re-published: other weights
        if round_index == 3:
            sequences["s3"] += backend.encode_continuation(" reply: ok")  # an environment's tokens
        live = [k for k in sequences if not trace.finished.get(k)]
        requests = [GenRequest(token_ids=list(sequences[k]), max_tokens=5 if k == "s1" else 6, version=versions[k],
                               key=f"g/{k}") for k in live]
        for key, output in zip(live, backend.generate(requests, greedy=greedy), strict=True):
            sequences[key] += output.token_ids
            trace.tokens[key] += output.token_ids
            trace.logprobs[key] += output.logprobs
            trace.finished[key] = output.finished
            if stop_id is not None:
                assert output.finished == (output.token_ids[-1] == stop_id)
    return trace


def backend_pair(model_dir: Path, sampling: Sampling, stop_ids: tuple[int, ...] = ()) -> tuple[HfBackend, HfBackend]:
    return tuple(HfBackend(model_dir, sampling=sampling, device="cpu", seed=0, kv_cache=kv, stop_token_ids=stop_ids)
                 for kv in (True, False))


def assert_same(cached: Trace, uncached: Trace) -> None:
    assert cached.tokens == uncached.tokens
    assert cached.finished == uncached.finished
    worst = max(abs(a - b) for k in cached.logprobs
                for a, b in zip(cached.logprobs[k], uncached.logprobs[k], strict=True))
    assert worst < 1e-5, f"cached log-probs differ from the uncached path's by {worst:.2e}"


@pytest.mark.parametrize("sampling", [None, Sampling(), Sampling(temperature=0.7, top_p=0.9)],
                         ids=["greedy", "sampled", "sampled-t0.7-p0.9"])
@pytest.mark.parametrize("long_rows_first", [False, True], ids=["one-forward", "long-rows-first"])
def test_cached_chunks_equal_the_uncached_path(tiny_model_dir: Path, store: AdapterStore, adapters: list[Adapter],
                                               sampling: Sampling | None, long_rows_first: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """(long-rows-first: every round whose rows feed different numbers of new tokens, the swap's re-reads and the
    environment's reply, reads the longer ones in a forward of their own first.)"""
    reads: list[int] = []
    if long_rows_first:
        layout = hf_decode._layout
        monkeypatch.setattr(hf_decode, "MAX_PADDED_POSITIONS", 0)
        monkeypatch.setattr(hf_decode, "_layout", lambda rows, *a: reads.extend(
            1 for r in rows if r.max_tokens == 0) or layout(rows, *a))
    cached, uncached = backend_pair(tiny_model_dir, sampling or Sampling())
    traces = [drive(b, store, adapters, greedy=sampling is None) for b in (cached, uncached)]
    assert_same(*traces)
    assert len(reads) >= (3 if long_rows_first else 0)  # s0 and s1 after the swap, s3 after its reply
    assert all(len(t) == (30 if k == "s1" else 36) or traces[0].finished[k] for k, t in traces[0].tokens.items())
    # the cache did its work: after round 1 only new tokens were read, except where a swap or a re-published
    # version forced a sample's prefix to be read again
    assert cached.num_prefix_tokens_reused > 0
    assert cached.num_tokens_read < uncached.num_tokens_read / 3


def test_a_row_ended_by_an_end_of_turn_id(tiny_model_dir: Path, store: AdapterStore,
                                          adapters: list[Adapter]) -> None:
    """A row that ends early is padded while the others go on, and its prefix is not kept."""
    probe = drive(backend_pair(tiny_model_dir, Sampling())[1], store, adapters, greedy=True)
    stop_id = probe.tokens["s0"][8]  # a token sample 0 generates in its second chunk
    cached, uncached = backend_pair(tiny_model_dir, Sampling(), stop_ids=(stop_id,))
    traces = [drive(b, store, adapters, greedy=True, stop_id=stop_id) for b in (cached, uncached)]
    assert_same(*traces)
    assert traces[0].finished["s0"]
    assert "g/s0" not in cached._prefixes


def test_prefixes_are_dropped_with_their_version_and_when_not_asked_for(tiny_model_dir: Path, store: AdapterStore,
                                                                        adapters: list[Adapter]) -> None:
    backend = backend_pair(tiny_model_dir, Sampling())[0]
    backend.add_adapter(receive(store, adapters[0], version=1))
    prompt = backend.encode(PROMPTS[0])
    requests = [GenRequest(token_ids=prompt, max_tokens=4, version=v, key=f"k{v}") for v in (0, 1)]
    outputs = backend.generate(requests, greedy=True)
    assert sorted(backend._prefixes) == ["k0", "k1"]
    held = backend._prefixes["k1"]
    assert held.token_ids == prompt + outputs[1].token_ids[:-1] and held.version == 1
    assert held.layers[0][0].shape[2] == len(held.token_ids)
    backend.retain(set())  # v1 unloaded: its prefix goes with it
    assert sorted(backend._prefixes) == ["k0"]
    backend.generate([GenRequest(token_ids=prompt, max_tokens=2, version=0, key="other")], greedy=True)
    assert sorted(backend._prefixes) == ["other"]  # k0 was not asked for in that call


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "gemma"])
def test_every_model_family_decodes_the_same_with_the_cache(zoo_model, family: str) -> None:  # noqa: ANN001
    """Attention bias, q/k norm, tied and scaled embeddings: the held keys and values are each family's own."""
    cached, uncached = (HfBackend(zoo_model(family), sampling=Sampling(), device="cpu", seed=0, kv_cache=kv)
                        for kv in (True, False))
    traces = []
    for backend in (cached, uncached):
        sequences = [backend.encode(p) for p in PROMPTS]
        trace = Trace(tokens={str(i): [] for i in range(len(sequences))},
                      logprobs={str(i): [] for i in range(len(sequences))})
        for _ in range(3):
            requests = [GenRequest(token_ids=list(s), max_tokens=4, version=0, key=str(i))
                        for i, s in enumerate(sequences)]
            for i, output in enumerate(backend.generate(requests, greedy=True)):
                sequences[i] += output.token_ids
                trace.tokens[str(i)] += output.token_ids
                trace.logprobs[str(i)] += output.logprobs
        traces.append(trace)
    assert_same(*traces)
    assert cached.num_prefix_tokens_reused > 0
