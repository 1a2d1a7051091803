"""Generation backends behind one interface (:mod:`.base`): ``hf`` (transformers), ``vllm``, ``sim`` (no model).

:func:`make_backend` builds the one ``worker.backend`` names; each module is imported only when chosen, so a
``sim`` worker never imports torch and an ``hf`` worker never imports vLLM.
"""

from __future__ import annotations

import zlib

from loraflow.common.config import Config
from loraflow.rollout_worker.backends.base import Backend, GenOutput, GenRequest, Sampling

__all__ = ["Backend", "GenOutput", "GenRequest", "Sampling", "make_backend", "resident_count"]


def resident_count(config: Config, max_staleness: int) -> int:
    """Adapter versions a worker keeps loaded: ``vllm.max_loras``, by default max_staleness + 2 (for each of
    ``worker.max_runs`` runs on a pool's shared worker)."""
    return config.worker.vllm.max_loras or (max_staleness + 2) * (config.worker.max_runs if config.worker.pool else 1)


def make_backend(config: Config, *, worker_id: str, max_staleness: int) -> Backend:
    """The backend ``config.worker.backend`` names, seeded per worker so workers draw different samples."""
    worker = config.worker
    sampling = Sampling(temperature=worker.temperature, top_p=worker.top_p)
    seed = (config.run.seed * 1_000_003 + zlib.crc32(worker_id.encode())) % (2**31)
    if worker.backend == "sim":
        from loraflow.rollout_worker.backends.sim import SimBackend

        return SimBackend(worker.sim, sampling=sampling, seed=seed)
    if worker.num_threads:
        import torch

        torch.set_num_threads(worker.num_threads)
    from loraflow.common.tiny_model import resolve_model

    model_dir = resolve_model(config.model.path, config.model.cache_dir)
    tokens = {"chat_template_kwargs": config.model.chat_template_kwargs, "stop_token_ids": worker.stop_token_ids}
    if worker.backend == "hf":
        from loraflow.rollout_worker.backends.hf import HfBackend

        return HfBackend(model_dir, sampling=sampling, device=worker.device, dtype=config.model.dtype, seed=seed,
                         **tokens)
    from loraflow.rollout_worker.backends.vllm import VllmBackend

    vllm = worker.vllm
    return VllmBackend(model_dir, sampling=sampling, max_loras=resident_count(config, max_staleness),
                       max_lora_rank=config.learner.lora_rank, dtype=config.model.dtype,
                       max_model_len=config.model.max_seq_len, max_num_seqs=vllm.max_num_seqs,
                       kv_cache_gib=vllm.kv_cache_gib, gpu_memory_utilization=vllm.gpu_memory_utilization,
                       enforce_eager=vllm.enforce_eager, seed=seed, **tokens)
