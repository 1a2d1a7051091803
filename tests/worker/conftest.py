"""Fixtures of the worker tests: adapters a learner would publish, a reference model, and the three backends.

Backends are expensive to start (vLLM ~25 s), so each is built once per session; the ``backend`` fixture hands
the session's instance to each test with every adapter unloaded, so tests do not see each other's versions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.common.config import SimConfig
from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.backends.base import Backend, Sampling
from tests.worker.helpers import Adapter, Reference, make_adapter

BACKENDS = ["hf", "sim", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """The machine has 2 cores shared by every test and by vLLM's engine."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def adapters(tiny_model_dir: Path) -> list[Adapter]:
    """Four different LoRA adapters (seeds 1..4) published as versions 1..4."""
    return [make_adapter(tiny_model_dir, version=i, seed=i) for i in range(1, 5)]


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_session_backend(tiny_model_dir: Path) -> Backend:
    from loraflow.rollout_worker.backends.hf import HfBackend

    return HfBackend(tiny_model_dir, sampling=Sampling(), device="cpu", seed=0)


@pytest.fixture(scope="session")
def sim_session_backend() -> Backend:
    from loraflow.rollout_worker.backends.sim import SimBackend

    return SimBackend(SimConfig(tokens_per_s=1e6, mean_tokens=1000, length_sigma=0.0, vocab_size=259),
                      sampling=Sampling(), seed=0)


@pytest.fixture(scope="session")
def vllm_session_backend(tiny_model_dir: Path) -> Iterator[Backend]:
    from loraflow.rollout_worker.backends.vllm import VllmBackend

    backend = VllmBackend(tiny_model_dir, sampling=Sampling(), max_loras=3, max_lora_rank=8, max_model_len=256,
                          max_num_seqs=16, kv_cache_gib=1, seed=0)
    yield backend
    backend.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend in turn, with no adapter resident."""
    instance: Backend = request.getfixturevalue(f"{request.param}_session_backend")
    instance.abort_all()  # requests an earlier test left streaming
    instance.retain(set())
    return instance


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return AdapterStore(tmp_path / "adapters")

