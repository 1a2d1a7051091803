"""Generation throughput of the vllm and hf backends on the tiny model with a LoRA adapter, same prompts, same run.

    .venv/bin/python bench/generation.py [--prompts 64] [--tokens 64] [--chunk 16] [--repeats 3]

Both backends serve the same rank-16 LoRA adapter (received the way a worker receives one: an AdapterUpdate
verified and written to a PEFT directory) and generate ``--tokens`` new tokens for each of ``--prompts`` arithmetic
prompts at temperature 1:

- ``one call``: one ``Backend.generate`` call for the whole batch (the engines' raw speed);
- ``chunked``: the worker's real path, ``Rollouts`` rounds of ``--chunk`` tokens (each round continues every
  sequence from its tokens so far, which is what lets adapters swap mid-generation).

Tokens/s counts the tokens actually generated (a sample may end early at EOS). vLLM's CPU backend binds its
OpenMP threads to one core; hf runs with one torch thread, so both use one core. The JSON line's value is vLLM's
one-call tokens/s, its reference hf's, measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(backend, requests, repeats: int) -> float:  # noqa: ANN001 - bench helper
    """Median tokens/s of one generate call over the batch."""
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = backend.generate(requests)
        elapsed = time.perf_counter() - started
        rates.append(sum(len(o.token_ids) for o in outputs) / elapsed)
    return statistics.median(rates)


def measure_chunked(backend, prompts: list[str], tokens: int, chunk: int, version: int) -> float:  # noqa: ANN001
    """Tokens/s of the worker's chunk rounds over the same prompts (one group of one sample per prompt)."""
    from common.config import WorkerConfig
    from common.protocol import PromptLease
    from rollout_worker.envs import EnvResolver
    from rollout_worker.rollout import Rollouts

    config = WorkerConfig(chunk_tokens=chunk, max_new_tokens=tokens, reward_timeout_s=30)
    rollouts = Rollouts(backend, EnvResolver(), config, worker_id="bench", max_seq_len=512)
    assert rollouts.current_version == version  # the backend's newest
    for i, prompt in enumerate(prompts):
        rollouts.add(PromptLease(lease_id=f"l{i}", group_id=f"0:{i}", prompt_index=i, epoch=0, task="arith",
                                 prompt=prompt, answer="", group_size=1, deadline_s=600))
    started = time.perf_counter()
    finished = []
    while rollouts.num_groups:
        finished += rollouts.step()
    elapsed = time.perf_counter() - started
    return sum(f.group.metrics["num_generated_tokens"] for f in finished) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from bench.report import report
    from common.tasks import ArithTask
    from common.tiny_model import resolve_model
    from rollout_worker.adapters import AdapterStore
    from rollout_worker.backends.base import GenRequest, Sampling
    from rollout_worker.backends.hf import HfBackend
    from rollout_worker.backends.vllm import VllmBackend
    from tests.worker.helpers import make_adapter, receive

    model_dir = resolve_model("builtin:tiny")
    adapter = receive(AdapterStore(tempfile.mkdtemp(prefix="bench-gen-")), make_adapter(model_dir, 1, seed=1, rank=16))
    task = ArithTask(seed=0)
    prompts = [task.item(i).prompt for i in range(args.prompts)]
    results = {}
    for name in ("vllm", "hf"):
        started = time.perf_counter()
        if name == "vllm":
            backend = VllmBackend(model_dir, sampling=Sampling(), max_loras=2, max_lora_rank=16, max_model_len=512,
                                  max_num_seqs=max(64, args.prompts))
        else:
            backend = HfBackend(model_dir, sampling=Sampling(), device="cpu")
        start_s = time.perf_counter() - started
        backend.add_adapter(adapter)
        requests = [GenRequest(token_ids=backend.encode(p), max_tokens=args.tokens, version=1) for p in prompts]
        backend.generate(requests[:4])  # warm-up
        results[name] = {"start_s": start_s, "one_call": measure(backend, requests, args.repeats),
                         "chunked": measure_chunked(backend, prompts, args.tokens, args.chunk, version=1)}
        print(f"{name:5s} start {start_s:6.1f} s   one call {results[name]['one_call']:8.0f} tok/s   "
              f"chunked ({args.chunk}-token rounds) {results[name]['chunked']:8.0f} tok/s", flush=True)
        backend.close()
    vllm, hf = results["vllm"], results["hf"]
    print(f"{args.prompts} prompts x {args.tokens} tokens, LoRA r=16, fp32, one core each; "
          f"vllm/hf = {vllm['one_call'] / hf['one_call']:.2f} (one call), {vllm['chunked'] / hf['chunked']:.2f} "
          f"(chunked)")
    report("generation", "vllm_tokens_per_s", vllm["one_call"], "tokens/s", hf["one_call"],
           hf_tokens_per_s=round(hf["one_call"], 1), vllm_chunked_tokens_per_s=round(vllm["chunked"], 1),
           hf_chunked_tokens_per_s=round(hf["chunked"], 1), prompts=args.prompts, tokens=args.tokens,
           chunk_tokens=args.chunk, lora_rank=16)


if __name__ == "__main__":
    main()
