"""Generation throughput of the worker's real path against one ``generate`` call over the same prompts, same run.

    .venv/bin/python -m bench.generation [--leases 48] [--tokens 256] [--capacity 16] [--swap-every 256]
        [--backends vllm,vllm-stock,hf,hf-nocache] [--finish-within 0] [--keep-within 0] [--repeats 1]

The workload: ``--leases`` arithmetic prompts with heavy-tailed group sizes (``GROUP_SIZES``) on the tiny model,
each sample generating until EOS or ``--tokens``, rank-16 LoRA adapters received as a worker receives them,
temperature 1, fp32.

- ``worker path``: ``Rollouts`` driven as the worker loop drives it, ``--capacity`` groups in hand (a finished
  group is replaced at once), a new adapter version loaded every ``--swap-every`` decode steps (``continue``).
  vLLM streams; hf runs ``--chunk``-token rounds (``hf-nocache``: without its KV cache; ``vllm-stock``: vLLM's own
  CPU LoRA ops instead of the grouped ones).
- ``one call``: one ``generate`` over every sample, one adapter, run just before each worker path (same load).

Comma-separated ``--swap-every`` (0: no swap), ``--finish-within`` and ``--keep-within`` (worker.finish_within_tokens,
worker.keep_version_within) run every combination, ``--repeats`` times interleaved; each figure is that of the run
with the median ratio. Swap latency: load start to the first token of the new version, in decode steps; swap cost:
the up to ``SWAP_COST_ROUNDS`` rounds after a load beyond the median round. The JSON line's value is vLLM's (else
the first backend's) worker-path tokens/s at the first variant, its reference the one call before it.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass, field

from bench import harness

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
    tokens_moved_per_swap: float = 0.0  # streaming: tokens of the requests a swap resubmits (re-read by the new version)
    swap_cost_s: list[float] = field(default_factory=list)  # per swap: what its rounds took beyond the median round


def make_leases(prompts: list[str], seed: int) -> list:  # noqa: ANN001 - PromptLease
    from loraflow.common.protocol import PromptLease

    rng = random.Random(seed)
    return [PromptLease(lease_id=f"l{i}", group_id=f"0:{i}", prompt_index=i, epoch=0, task="arith", prompt=prompt,
                        answer="", group_size=rng.choice(GROUP_SIZES), deadline_s=600)
            for i, prompt in enumerate(prompts)]


def one_call(backend, leases: list, tokens: int, version: int) -> PathResult:  # noqa: ANN001
    """Tokens/s of one generate call over every sample of every lease."""
    from loraflow.rollout_worker.backends.base import GenRequest

    requests = [GenRequest(token_ids=backend.encode(lease.prompt), max_tokens=tokens, version=version)
                for lease in leases for _ in range(lease.group_size)]
    started = time.perf_counter()
    outputs = backend.generate(requests)
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return PathResult(tokens_per_s=num_tokens / elapsed, num_tokens=num_tokens, elapsed_s=elapsed)


def worker_path(backend, leases: list, adapters: list, *, tokens: int, chunk: int, capacity: int,  # noqa: ANN001
                swap_every: int, finish_within: int = 0, keep_within: int = 0) -> PathResult:
    """Tokens/s of Rollouts fed like the worker feeds it, a new adapter every ``swap_every`` engine steps."""
    from loraflow.common.config import WorkerConfig
    from loraflow.rollout_worker.envs import EnvResolver
    from loraflow.rollout_worker.rollout import Rollouts

    config = WorkerConfig(chunk_tokens=chunk, max_new_tokens=tokens, reward_timeout_s=30, partial_policy="continue",
                          finish_within_tokens=finish_within, keep_version_within=keep_within)
    rollouts = Rollouts(backend, EnvResolver(), config, worker_id="bench", max_seq_len=512)
    pending = list(leases)
    waiting = list(adapters)  # received, not loaded yet
    step_s: list[float] = []
    round_s: list[float] = []
    round_cpu_s: list[float] = []
    tokens_read = getattr(backend, "num_tokens_read", 0)
    swap_steps_s: list[float] = []  # per swap, seconds from load to the first token of the new version
    in_swap: dict[int, tuple[float, int]] = {}  # version -> (load started, steps until then): no token of it yet
    load_ms: list[float] = []
    load_rounds: list[int] = []  # per swap: the rounds before its load
    steps_after_load: list[int] = []
    num_tokens = 0
    num_steps = steps_since_swap = 0
    tokens_per_step = 1 if backend.streaming else chunk
    started = time.perf_counter()
    while pending or rollouts.num_groups:
        if waiting and steps_since_swap * tokens_per_step >= swap_every:  # on schedule, whatever the last one did
            adapter = waiting.pop(0)
            load_started = time.perf_counter()
            in_swap[adapter.version] = (load_started, num_steps)
            load_rounds.append(num_steps)
            backend.add_adapter(adapter)  # what Worker._load_adapter does, then retain
            backend.retain({backend.newest_version} | rollouts.versions_in_use())
            load_ms.append((time.perf_counter() - load_started) * 1e3)
            steps_since_swap = 0
        while pending and rollouts.num_groups < capacity:
            rollouts.add(pending.pop(0))
        lengths = [] if backend.streaming else [(s, len(s.completion_ids)) for g in rollouts.groups.values()
                                                for s in g.samples]  # a chunked round's advance, below
        step_started, cpu_started = time.perf_counter(), time.process_time()
        finished = rollouts.step()
        now = time.perf_counter()
        round_s.append(now - step_started)
        round_cpu_s.append(time.process_time() - cpu_started)
        # the swap schedule counts decode steps: one per engine step, a chunked round's longest advance
        steps_since_swap += 1 if backend.streaming else max((len(s.completion_ids) - n for s, n in lengths),
                                                             default=0) / chunk
        num_steps += 1
        num_tokens += sum(f.group.metrics["num_generated_tokens"] for f in finished)
        if not in_swap:
            step_s.append(now - step_started)
        for version, (load_started, steps_before) in list(in_swap.items()):
            if swapped(rollouts, finished, version):
                swap_steps_s.append(now - load_started)
                steps_after_load.append(num_steps - steps_before)
                del in_swap[version]
    elapsed = time.perf_counter() - started
    decode_step_s = statistics.median(step_s or round_s) / tokens_per_step  # steps with no swap pending
    moved = rollouts.metrics.total("tokens_moved")
    typical = statistics.median(round_s)
    swap_cost_s = [sum(r - typical for r in round_s[start:min(start + SWAP_COST_ROUNDS, end)])
                   for start, end in zip(load_rounds, [*load_rounds[1:], len(round_s)], strict=False)]
    return PathResult(swap_cost_s=swap_cost_s, tokens_per_s=num_tokens / elapsed, num_tokens=num_tokens, elapsed_s=elapsed,
                      decode_step_ms=decode_step_s * 1e3, swap_steps=[s / decode_step_s for s in swap_steps_s],
                      num_swaps=len(load_ms), load_ms=load_ms,
                      steps_after_load=steps_after_load, num_rounds=len(round_s),
                      round_ms=statistics.median(round_s) * 1e3, round_cpu_ms=statistics.median(round_cpu_s) * 1e3,
                      tokens_read_per_round=(getattr(backend, "num_tokens_read", 0) - tokens_read) / len(round_s),
                      tokens_moved_per_swap=moved / len(load_ms) if load_ms else 0.0)


#: rounds after a load that count toward its cost (:func:`worker_path`): a swap's re-read is over well within them
SWAP_COST_ROUNDS = 40


def swapped(rollouts, finished: list, version: int) -> bool:  # noqa: ANN001
    """Whether a token of ``version`` has been generated (in a group under way or just finished)."""
    if any(int(f.tensors[3][1].max(initial=0)) >= version for f in finished):
        return True
    return any(s.versions and s.versions[-1] >= version and s.loss_mask[-1]
               for g in rollouts.groups.values() for s in g.samples)



def swap_label(every: int, finish_within: int = 0, keep_within: int = 0) -> str:
    label = f"every {every}" if every else "no swap"
    label += f", finish within {finish_within}" if finish_within else ""
    return label + (f", keep within {keep_within}" if keep_within else "")


def main() -> None:
    parser = harness.flags(harness.parser(__doc__, repeats=1), {
        "leases": 48, "tokens": (256, "max new tokens per sample"), "capacity": (16, "groups in hand (worker.capacity)"),
        "swap_every": ("256", "decode steps between adapter versions (list; 0: none)"),
        "chunk": (16, "tokens per round of a backend that does not stream"),
        "backends": ("vllm", "list of: vllm, vllm-stock, hf, hf-nocache"), "seed": 0,
        "finish_within": ("0", "worker.finish_within_tokens (list)"),
        "keep_within": ("0", "worker.keep_version_within (list)")})
    args = harness.parse(parser, None, backends="hf", leases=4, tokens=16, capacity=4, swap_every="8")
    swap_everies = harness.sizes(args.swap_every)
    variants = [(every, w, k) for every in swap_everies for w in harness.sizes(args.finish_within)
                for k in harness.sizes(args.keep_within)]

    import torch

    torch.set_num_threads(1)
    from loraflow.common.tasks import ArithTask
    from loraflow.common.tiny_model import resolve_model
    from loraflow.rollout_worker.adapters import AdapterStore
    from tests.worker.helpers import make_adapter, receive

    model_dir = resolve_model("builtin:tiny")
    published = [make_adapter(model_dir, 1, seed=s, rank=16) for s in (1, 2)]
    task = ArithTask(seed=0)
    leases = make_leases([task.item(i).prompt for i in range(args.leases)], args.seed)
    num_samples = sum(lease.group_size for lease in leases)
    print(f"{args.leases} leases, {num_samples} samples, <= {args.tokens} tokens each, {args.capacity} groups in hand; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[tuple[str, int, int, int], list[tuple[PathResult, PathResult, float]]] = {}
    for name in args.backends.split(","):
        store = AdapterStore(harness.scratch_dir(prefix=f"bench-gen-{name}-"))
        # received ahead (as the session's thread does): v1 for the one call and the worker path's start, then
        # alternating weights as v2, v3, ...
        num_versions = 1 + args.repeats * sum(4000 // v[0] for v in variants if v[0])
        received = [receive(store, published[(v - 1) % 2], version=v) for v in range(1, 2 + num_versions)]
        started = time.perf_counter()
        backend = harness.tiny_backend(name, model_dir, seed=args.seed, **(
            dict(max_loras=3, max_lora_rank=16, max_model_len=512, grouped_lora_ops=name != "vllm-stock")
            if name.startswith("vllm") else dict(kv_cache=name != "hf-nocache")))
        start_s = time.perf_counter() - started
        backend.add_adapter(received[0])
        one_call(backend, leases[:2], 8, version=1)  # warm-up
        next_version = 1
        for every, within, keep in variants * args.repeats:
            backend.add_adapter(received[0])
            backend.retain({1})
            reference = one_call(backend, leases, args.tokens, version=1)  # just before its worker path: same load
            num = 4000 // every if every else 0
            path = worker_path(backend, leases, received[next_version:next_version + num], tokens=args.tokens,
                               chunk=args.chunk, capacity=args.capacity, swap_every=every or 10**9,
                               finish_within=within, keep_within=keep)
            next_version += num
            swap = harness.median(path.swap_steps)
            runs.setdefault((name, every, within, keep), []).append((reference, path, swap))
            print(f"{name:10s} {swap_label(every, within, keep):11s} start {start_s:5.1f} s   one call "
                  f"{reference.tokens_per_s:7.0f} tok/s   worker path {path.tokens_per_s:7.0f} tok/s ({path.num_tokens} "
                  f"tokens, {path.num_swaps} swaps, {path.tokens_moved_per_swap:.0f} tokens re-read and "
                  f"{harness.median(path.swap_cost_s) * 1e3:.0f} ms beyond the median round per swap)   ratio "
                  f"{path.tokens_per_s / reference.tokens_per_s:.3f}   swap -> first token {swap:.2f} decode steps "
                  f"(one {path.decode_step_ms:.1f} ms; the load {harness.median(path.load_ms):.1f} ms, then "
                  f"{harness.median(path.steps_after_load)} engine steps)   load average {os.getloadavg()[0]:.1f}",
                  flush=True)
            if not backend.streaming:
                print(f"{'':10s} {path.num_rounds} rounds: {path.tokens_read_per_round:.0f} tokens read per round, "
                      f"one round {path.round_ms:.1f} ms wall, {path.round_cpu_ms:.1f} ms CPU (median)", flush=True)
        backend.close()
    results = {}  # per backend and variant: the run with the median ratio
    for key, found in runs.items():
        found.sort(key=lambda run: run[1].tokens_per_s / run[0].tokens_per_s)
        results[key] = found[(len(found) - 1) // 2]
    names = list(dict.fromkeys(key[0] for key in results))
    main_key = ("vllm" if "vllm" in names else names[0], *variants[0])
    reference, path, swap = results[main_key]
    extra: dict[str, float] = {}
    for (n, every, within, keep), (r, p, s) in results.items():
        if (n, every, within, keep) == main_key:
            continue
        key = n.replace("-", "_") + ("" if every == main_key[1] else f"_every_{every}" if every else "_no_swap")
        key += "" if within == main_key[2] else f"_finish_within_{within}"
        key += "" if keep == main_key[3] else f"_keep_within_{keep}"
        extra[f"{key}_ratio"] = round(p.tokens_per_s / r.tokens_per_s, 3)
        if every:
            extra[f"{key}_swap_decode_steps"] = round(s, 2)
        if n.startswith("hf"):
            extra[f"{key}_round_ms"] = round(p.round_ms, 2)
            extra[f"{key}_tokens_read_per_round"] = round(p.tokens_read_per_round)
    if ("hf", *variants[0]) in results and ("hf-nocache", *variants[0]) in results:
        cached, uncached = results["hf", *variants[0]][1], results["hf-nocache", *variants[0]][1]  # same run
        extra["hf_kv_cache_speedup"] = round(cached.tokens_per_s / uncached.tokens_per_s, 3)
    harness.report("generation", f"{main_key[0]}_worker_path_tokens_per_s", path.tokens_per_s, "tokens/s",
                   reference.tokens_per_s, swap_decode_steps=round(swap, 2), decode_step_ms=round(path.decode_step_ms, 2),
                   swap_load_ms=round(harness.median(path.load_ms), 1),
                   swap_engine_steps=harness.median(path.steps_after_load),
                   tokens_moved_per_swap=round(path.tokens_moved_per_swap), num_swaps=path.num_swaps,
                   leases=args.leases, swap_cost_ms=round(harness.median(path.swap_cost_s) * 1e3, 1),
                   samples=num_samples, tokens=args.tokens, capacity=args.capacity, swap_every=main_key[1],
                   finish_within_tokens=main_key[2], keep_version_within=main_key[3], lora_rank=16,
                   load_average=round(os.getloadavg()[0], 1), **extra)


if __name__ == "__main__":
    main()
