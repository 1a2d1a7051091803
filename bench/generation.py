"""Generation throughput of the worker's real path against one ``generate`` call over the same prompts, same run.

    .venv/bin/python bench/generation.py [--leases 48] [--tokens 256] [--capacity 16] [--swap-every 64]
                                         [--backends vllm] [--chunk 16]
    .venv/bin/python bench/generation.py --backends hf,hf-nocache --leases 16 --tokens 384   # hf's KV cache

The workload is a long-tailed stream of leases on the tiny model with rank-16 LoRA adapters (received the way a
worker receives them: AdapterUpdates verified and written to PEFT directories), temperature 1, fp32:

- ``--leases`` arithmetic prompts whose group sizes are heavy-tailed (mostly 1-2 samples, a few 8 or 16), each
  sample generating until EOS or ``--tokens`` (the tiny model's EOS gives lengths from a few tokens to the cap);
- ``worker path``: :class:`rollout_worker.rollout.Rollouts` driven as the worker loop drives it, with
  ``--capacity`` groups in hand: a finished group is replaced by the next lease at once (the worker's long-poll),
  and a new adapter version is loaded every ``--swap-every`` engine steps (``partial_policy = "continue"``: the
  samples under way continue under it). vLLM streams (``backend.streaming``: requests join the running batch,
  a sample is split only at a swap); hf runs ``--chunk``-token rounds, each sample's KV cache kept from one
  round to the next (``hf-nocache``: the same backend with ``kv_cache=False``, ``generate`` re-reading every
  sequence each round, the path before the cache; per round the bench prints the tokens read before the first
  new token (prefill) and the round's wall and CPU milliseconds);
- ``one call``: one ``Backend.generate`` call for every sample of every lease at once, one adapter, the same
  token cap (the engine's raw speed: nothing arrives, nothing swaps).

Tokens/s counts the tokens actually generated. Swap latency: from the start of loading a new version (already
received: the transfer is not in it) to the first token generated with it, in decode steps (the median duration
of one engine step of the worker path; for a chunked backend, of one round divided by ``--chunk``). vLLM's CPU
backend binds its OpenMP threads to one core; hf runs with one torch thread. The JSON line's value is vLLM's
worker-path tokens/s, its reference the one-call tokens/s of the same run, ``ratio`` worker path / one call.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GROUP_SIZES = (1, 1, 1, 2, 2, 4, 8, 16)  # drawn uniformly: a heavy tail of large groups


@dataclass
class PathResult:
    tokens_per_s: float
    num_tokens: int
    elapsed_s: float
    decode_step_ms: float = 0.0
    swap_steps: list[float] = field(default_factory=list)  # per swap: load -> first token, in decode steps
    load_ms: list[float] = field(default_factory=list)  # per swap: the load itself (add_adapter + retain)
    steps_after_load: list[int] = field(default_factory=list)  # per swap: engine steps until its first token
    num_swaps: int = 0
    num_rounds: int = 0
    round_ms: float = 0.0  # median wall time of one round (rollouts.step)
    round_cpu_ms: float = 0.0  # median CPU time of this process in one round
    tokens_read_per_round: float = 0.0  # hf: tokens fed before each chunk's first new token, per round


def make_leases(prompts: list[str], seed: int) -> list:  # noqa: ANN001 - PromptLease
    from common.protocol import PromptLease

    rng = random.Random(seed)
    return [PromptLease(lease_id=f"l{i}", group_id=f"0:{i}", prompt_index=i, epoch=0, task="arith", prompt=prompt,
                        answer="", group_size=rng.choice(GROUP_SIZES), deadline_s=600)
            for i, prompt in enumerate(prompts)]


def one_call(backend, leases: list, tokens: int, version: int) -> PathResult:  # noqa: ANN001
    """Tokens/s of one generate call over every sample of every lease."""
    from rollout_worker.backends.base import GenRequest

    requests = [GenRequest(token_ids=backend.encode(lease.prompt), max_tokens=tokens, version=version)
                for lease in leases for _ in range(lease.group_size)]
    started = time.perf_counter()
    outputs = backend.generate(requests)
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return PathResult(tokens_per_s=num_tokens / elapsed, num_tokens=num_tokens, elapsed_s=elapsed)


def worker_path(backend, leases: list, adapters: list, *, tokens: int, chunk: int, capacity: int,  # noqa: ANN001
                swap_every: int) -> PathResult:
    """Tokens/s of Rollouts fed like the worker feeds it, a new adapter every ``swap_every`` engine steps."""
    from common.config import WorkerConfig
    from rollout_worker.envs import EnvResolver
    from rollout_worker.rollout import Rollouts

    config = WorkerConfig(chunk_tokens=chunk, max_new_tokens=tokens, reward_timeout_s=30, partial_policy="continue")
    rollouts = Rollouts(backend, EnvResolver(), config, worker_id="bench", max_seq_len=512)
    pending = list(leases)
    waiting = list(adapters)  # received, not loaded yet
    step_s: list[float] = []
    round_s: list[float] = []
    round_cpu_s: list[float] = []
    tokens_read = getattr(backend, "num_tokens_read", 0)
    swap_steps_s: list[float] = []  # per swap, seconds from load to the first token of the new version
    in_swap: tuple[int, float] | None = None  # (version, load started)
    load_ms: list[float] = []
    steps_after_load: list[int] = []
    num_tokens = 0
    steps_since_swap = 0
    tokens_per_step = 1 if backend.streaming else chunk
    started = time.perf_counter()
    while pending or rollouts.num_groups:
        if waiting and in_swap is None and steps_since_swap * tokens_per_step >= swap_every:
            adapter = waiting.pop(0)
            in_swap = (adapter.version, time.perf_counter())
            backend.add_adapter(adapter)  # what Worker._load_adapter does, then retain
            backend.retain({backend.newest_version} | rollouts.versions_in_use())
            load_ms.append((time.perf_counter() - in_swap[1]) * 1e3)
            steps_since_swap = 0
        while pending and rollouts.num_groups < capacity:
            rollouts.add(pending.pop(0))
        step_started, cpu_started = time.perf_counter(), time.process_time()
        finished = rollouts.step()
        now = time.perf_counter()
        round_s.append(now - step_started)
        round_cpu_s.append(time.process_time() - cpu_started)
        steps_since_swap += 1
        num_tokens += sum(f.group.metrics["num_generated_tokens"] for f in finished)
        if in_swap is None:
            step_s.append(now - step_started)
        elif swapped(rollouts, finished, in_swap[0]):
            swap_steps_s.append(now - in_swap[1])
            steps_after_load.append(steps_since_swap)
            in_swap = None
    elapsed = time.perf_counter() - started
    decode_step_s = statistics.median(step_s) / tokens_per_step
    return PathResult(tokens_per_s=num_tokens / elapsed, num_tokens=num_tokens, elapsed_s=elapsed,
                      decode_step_ms=decode_step_s * 1e3, swap_steps=[s / decode_step_s for s in swap_steps_s],
                      num_swaps=len(swap_steps_s), load_ms=load_ms[:len(swap_steps_s)],
                      steps_after_load=steps_after_load, num_rounds=len(round_s),
                      round_ms=statistics.median(round_s) * 1e3, round_cpu_ms=statistics.median(round_cpu_s) * 1e3,
                      tokens_read_per_round=(getattr(backend, "num_tokens_read", 0) - tokens_read) / len(round_s))


def swapped(rollouts, finished: list, version: int) -> bool:  # noqa: ANN001
    """Whether a token of ``version`` has been generated (in a group under way or just finished)."""
    if any(int(f.tensors[3][1].max(initial=0)) >= version for f in finished):
        return True
    return any(s.versions and s.versions[-1] >= version and s.loss_mask[-1]
               for g in rollouts.groups.values() for s in g.samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leases", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=256, help="max new tokens per sample")
    parser.add_argument("--capacity", type=int, default=16, help="groups in hand (worker.capacity)")
    parser.add_argument("--swap-every", type=int, default=64, help="decode steps between adapter versions")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per round of a backend that does not stream")
    parser.add_argument("--backends", default="vllm", help="comma-separated: vllm, hf, hf-nocache")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, help="vLLM's per-step budget (0: its own)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from bench.report import report
    from common.tasks import ArithTask
    from common.tiny_model import resolve_model
    from rollout_worker.adapters import AdapterStore
    from rollout_worker.backends.base import Sampling
    from tests.worker.helpers import make_adapter, receive

    model_dir = resolve_model("builtin:tiny")
    published = [make_adapter(model_dir, 1, seed=s, rank=16) for s in (1, 2)]
    task = ArithTask(seed=0)
    leases = make_leases([task.item(i).prompt for i in range(args.leases)], args.seed)
    num_samples = sum(lease.group_size for lease in leases)
    print(f"{args.leases} leases, {num_samples} samples (group sizes {GROUP_SIZES}), <= {args.tokens} tokens each, "
          f"{args.capacity} groups in hand, a new adapter every {args.swap_every} decode steps", flush=True)
    results = {}
    for name in args.backends.split(","):
        store = AdapterStore(tempfile.mkdtemp(prefix=f"bench-gen-{name}-"))
        # received ahead (the session's thread does it while the loop generates): v1 for the one call and the
        # start of the worker path, then alternating weights as v2, v3, ...
        received = [receive(store, published[(v - 1) % 2], version=v) for v in range(1, 2 + 4000 // args.swap_every)]
        started = time.perf_counter()
        if name == "vllm":
            from rollout_worker.backends.vllm import VllmBackend

            backend = VllmBackend(model_dir, sampling=Sampling(), max_loras=3, max_lora_rank=16, max_model_len=512,
                                  max_num_seqs=args.max_num_seqs, seed=args.seed,
                                  max_num_batched_tokens=args.max_num_batched_tokens or None)
        else:
            from rollout_worker.backends.hf import HfBackend

            backend = HfBackend(model_dir, sampling=Sampling(), device="cpu", seed=args.seed,
                                kv_cache=name != "hf-nocache")
        start_s = time.perf_counter() - started
        backend.add_adapter(received[0])
        one_call(backend, leases[:2], 8, version=1)  # warm-up
        reference = one_call(backend, leases, args.tokens, version=1)
        path = worker_path(backend, leases, received[1:], tokens=args.tokens, chunk=args.chunk,
                           capacity=args.capacity, swap_every=args.swap_every)
        backend.close()
        swap = statistics.median(path.swap_steps) if path.swap_steps else float("nan")
        results[name] = (reference, path, swap)
        print(f"{name:10s} start {start_s:5.1f} s   one call {reference.tokens_per_s:7.0f} tok/s "
              f"({reference.num_tokens} tokens)   worker path {path.tokens_per_s:7.0f} tok/s ({path.num_tokens} tokens, "
              f"{path.num_swaps} swaps)   ratio {path.tokens_per_s / reference.tokens_per_s:.3f}   swap -> first "
              f"token {swap:.2f} decode steps (one step {path.decode_step_ms:.1f} ms; max "
              f"{max(path.swap_steps, default=float('nan')):.2f}; of which the load "
              f"{statistics.median(path.load_ms or [float('nan')]):.1f} ms, then "
              f"{statistics.median(path.steps_after_load or [float('nan')])} engine steps)", flush=True)
        if not backend.streaming:
            print(f"{'':10s} {path.num_rounds} rounds of <= {args.chunk} tokens: {path.tokens_read_per_round:.0f} "
                  f"tokens read per round before its first new token, one round {path.round_ms:.1f} ms wall, "
                  f"{path.round_cpu_ms:.1f} ms CPU (median)", flush=True)
    main_name = "vllm" if "vllm" in results else next(iter(results))
    reference, path, swap = results[main_name]
    extra = {f"{n.replace('-', '_')}_{k}": v for n, (r, p, s) in results.items() if n != main_name
             for k, v in (("one_call_tokens_per_s", round(r.tokens_per_s, 1)),
                          ("worker_path_tokens_per_s", round(p.tokens_per_s, 1)), ("swap_decode_steps", round(s, 2)),
                          ("round_ms", round(p.round_ms, 2)), ("tokens_read_per_round", round(p.tokens_read_per_round)))}
    if "hf" in results and "hf-nocache" in results:  # the KV cache's gain, same run
        cached, uncached = results["hf"][1], results["hf-nocache"][1]
        print(f"hf worker path: KV cache {cached.tokens_per_s:.0f} tok/s vs re-reading the prefix "
              f"{uncached.tokens_per_s:.0f} tok/s = {cached.tokens_per_s / uncached.tokens_per_s:.2f}x; tokens read "
              f"per round {cached.tokens_read_per_round:.0f} vs {uncached.tokens_read_per_round:.0f}; one round "
              f"{cached.round_ms:.1f} vs {uncached.round_ms:.1f} ms", flush=True)
        extra["hf_kv_cache_speedup"] = round(cached.tokens_per_s / uncached.tokens_per_s, 3)
    report("generation", f"{main_name}_worker_path_tokens_per_s", path.tokens_per_s, "tokens/s",
           reference.tokens_per_s, swap_decode_steps=round(swap, 2), decode_step_ms=round(path.decode_step_ms, 2),
           swap_load_ms=round(statistics.median(path.load_ms or [float("nan")]), 1),
           swap_engine_steps=statistics.median(path.steps_after_load or [float("nan")]),
           num_swaps=path.num_swaps, leases=args.leases, samples=num_samples, tokens=args.tokens,
           capacity=args.capacity, swap_every=args.swap_every, lora_rank=16, **extra)


if __name__ == "__main__":
    main()
