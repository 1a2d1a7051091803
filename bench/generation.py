"""Generation throughput of the worker's real path against one ``generate`` call over the same prompts, same run.

    .venv/bin/python -m bench.generation [--leases 48] [--tokens 256] [--capacity 16] [--swap-every 256]
                                         [--backends vllm] [--chunk 16]
    .venv/bin/python -m bench.generation --swap-every 256,64,128,512,0 --repeats 3   # the table
    .venv/bin/python -m bench.generation --backends vllm-stock,vllm --swap-every 256,0   # grouped LoRA ops or not
    .venv/bin/python -m bench.generation --backends hf,hf-nocache --leases 16 --tokens 384   # hf's KV cache
    .venv/bin/python -m bench.generation --swap-every 256,128,64 --keep-within 0,2   # worker.keep_version_within

The workload is a long-tailed stream of leases on the tiny model with rank-16 LoRA adapters (received the way a
worker receives them: AdapterUpdates verified and written to PEFT directories), temperature 1, fp32:

- ``--leases`` arithmetic prompts whose group sizes are heavy-tailed (mostly 1-2 samples, a few 8 or 16), each
  sample generating until EOS or ``--tokens`` (the tiny model's EOS gives lengths from a few tokens to the cap);
- ``worker path``: :class:`loraflow.rollout_worker.rollout.Rollouts` driven as the worker loop drives it, with
  ``--capacity`` groups in hand: a finished group is replaced by the next lease at once (the worker's long-poll),
  and a new adapter version is loaded every ``--swap-every`` engine steps (``partial_policy = "continue"``: the
  samples under way continue under it). vLLM streams (``backend.streaming``: requests join the running batch,
  a sample is split only at a swap); hf runs ``--chunk``-token rounds, each sample's KV cache kept from one
  round to the next (``hf-nocache``: the same backend with ``kv_cache=False``, ``generate`` re-reading every
  sequence each round, the path before the cache; per round the bench prints the tokens read before the first
  new token (prefill) and the round's wall and CPU milliseconds);
- ``one call``: one ``Backend.generate`` call for every sample of every lease at once, one adapter, the same
  token cap (the engine's raw speed: nothing arrives, nothing swaps), run just before each worker path so that both
  see the same machine load.

``--finish-within`` and ``--keep-within`` set ``worker.finish_within_tokens`` and ``worker.keep_version_within`` of
the worker path (comma-separated lists: every combination runs, interleaved). Adapters are loaded on schedule
whether or not the previous one has produced a token yet (a turn that keeps its version delays that token).

``--swap-every`` may list several intervals (0: no swap), each run in turn on the same engine with its own one-call
reference, ``--repeats`` times (interleaved; each figure is that of the run with the median ratio); ``vllm-stock`` is the vLLM backend with vLLM's own CPU LoRA ops instead of the grouped ones
(``rollout_worker/backends/vllm_lora_cpu.py``). Per swap the bench prints the tokens the swap resubmits (prompt and
tokens so far of every moved request: what the new version re-reads before its first token of each).

Tokens/s counts the tokens actually generated. Swap latency: from the start of loading a new version (already
received: the transfer is not in it) to the first token generated with it, in decode steps (the median duration
of one engine step of the worker path; for a chunked backend, of one round divided by ``--chunk``). Swap cost
(``swap_cost_ms``, median over swaps): what the up to 40 rounds after a load took beyond the median round, i.e.
the engine time the swap's re-read and its effects cost. vLLM's CPU
backend binds its OpenMP threads to one core; hf runs with one torch thread. The JSON line's value is vLLM's
worker-path tokens/s at the first ``--swap-every``, its reference the one-call tokens/s run just before it,
``ratio`` worker path / one call; the other intervals and backends add ``*_ratio`` and ``*_swap_decode_steps``.
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
    parser = harness.parser(__doc__)
    parser.add_argument("--leases", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=256, help="max new tokens per sample")
    parser.add_argument("--capacity", type=int, default=16, help="groups in hand (worker.capacity)")
    parser.add_argument("--swap-every", default="256",
                        help="decode steps between adapter versions; a comma-separated list runs each in turn, the "
                             "first is the JSON line's figure; 0: no swap")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per round of a backend that does not stream")
    parser.add_argument("--backends", default="vllm",
                        help="comma-separated: vllm, vllm-stock (vLLM's own CPU LoRA ops), hf, hf-nocache")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, help="vLLM's per-step budget (0: its own)")
    parser.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                        help="vLLM's async scheduling (auto: vLLM's choice)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each interval (interleaved); the figures are those of the median ratio")
    parser.add_argument("--finish-within", default="0",
                        help="worker.finish_within_tokens of the worker path; a comma-separated list runs each in "
                             "turn (interleaved), the first is the JSON line's figure")
    parser.add_argument("--keep-within", default="0",
                        help="worker.keep_version_within of the worker path (versions); a comma-separated list runs "
                             "each in turn (interleaved), the first is the JSON line's figure")
    parser.add_argument("--seed", type=int, default=0)
    args = harness.parse(parser, None, backends="hf", leases=4, tokens=16, capacity=4, swap_every="8")
    swap_everies = [int(x) for x in args.swap_every.split(",")]
    variants = [(int(w), int(k)) for w in args.finish_within.split(",") for k in args.keep_within.split(",")]

    import torch

    torch.set_num_threads(1)
    from bench.report import report, scratch_dir
    from loraflow.common.tasks import ArithTask
    from loraflow.common.tiny_model import resolve_model
    from loraflow.rollout_worker.adapters import AdapterStore
    from loraflow.rollout_worker.backends.base import Sampling
    from tests.worker.helpers import make_adapter, receive

    model_dir = resolve_model("builtin:tiny")
    published = [make_adapter(model_dir, 1, seed=s, rank=16) for s in (1, 2)]
    task = ArithTask(seed=0)
    leases = make_leases([task.item(i).prompt for i in range(args.leases)], args.seed)
    num_samples = sum(lease.group_size for lease in leases)
    print(f"{args.leases} leases, {num_samples} samples (group sizes {GROUP_SIZES}), <= {args.tokens} tokens each, "
          f"{args.capacity} groups in hand; a new adapter every {args.swap_every} decode steps (0: none); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[tuple[str, int, int, int], list[tuple[PathResult, PathResult, float]]] = {}
    for name in args.backends.split(","):
        store = AdapterStore(scratch_dir(prefix=f"bench-gen-{name}-"))
        # received ahead (the session's thread does it while the loop generates): v1 for the one call and the
        # start of the worker path, then alternating weights as v2, v3, ...
        num_versions = 1 + args.repeats * len(variants) * sum(4000 // every for every in swap_everies if every)
        received = [receive(store, published[(v - 1) % 2], version=v) for v in range(1, 2 + num_versions)]
        started = time.perf_counter()
        if name.startswith("vllm"):
            from loraflow.rollout_worker.backends.vllm import VllmBackend

            backend = VllmBackend(model_dir, sampling=Sampling(), max_loras=3, max_lora_rank=16, max_model_len=512,
                                  max_num_seqs=args.max_num_seqs, seed=args.seed,
                                  max_num_batched_tokens=args.max_num_batched_tokens or None,
                                  grouped_lora_ops=name != "vllm-stock",
                                  async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
        else:
            from loraflow.rollout_worker.backends.hf import HfBackend

            backend = HfBackend(model_dir, sampling=Sampling(), device="cpu", seed=args.seed,
                                kv_cache=name != "hf-nocache")
        start_s = time.perf_counter() - started
        backend.add_adapter(received[0])
        one_call(backend, leases[:2], 8, version=1)  # warm-up
        next_version = 1
        for every, (within, keep) in [(e, v) for _ in range(args.repeats) for e in swap_everies for v in variants]:
            backend.add_adapter(received[0])
            backend.retain({1})
            reference = one_call(backend, leases, args.tokens, version=1)  # just before its worker path: same load
            num = 4000 // every if every else 0
            path = worker_path(backend, leases, received[next_version:next_version + num], tokens=args.tokens,
                               chunk=args.chunk, capacity=args.capacity, swap_every=every or 10**9,
                               finish_within=within, keep_within=keep)
            next_version += num
            swap = statistics.median(path.swap_steps) if path.swap_steps else float("nan")
            runs.setdefault((name, every, within, keep), []).append((reference, path, swap))
            moved = f", {path.tokens_moved_per_swap:.0f} tokens re-read per swap" if path.tokens_moved_per_swap else ""
            if path.swap_cost_s:
                moved += f", each costing {statistics.median(path.swap_cost_s) * 1e3:.0f} ms of rounds beyond the median"
            print(f"{name:10s} {swap_label(every, within, keep):11s} start {start_s:5.1f} s   one call {reference.tokens_per_s:7.0f} "
                  f"tok/s ({reference.num_tokens} tokens)   worker path {path.tokens_per_s:7.0f} tok/s "
                  f"({path.num_tokens} tokens, {path.num_swaps} swaps{moved})   ratio "
                  f"{path.tokens_per_s / reference.tokens_per_s:.3f}   swap -> first token {swap:.2f} decode steps "
                  f"(one step {path.decode_step_ms:.1f} ms; max {max(path.swap_steps, default=float('nan')):.2f}; "
                  f"of which the load {statistics.median(path.load_ms or [float('nan')]):.1f} ms, then "
                  f"{statistics.median(path.steps_after_load or [float('nan')])} engine steps)   load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            if not backend.streaming:
                print(f"{'':10s} {path.num_rounds} rounds of <= {args.chunk} tokens: {path.tokens_read_per_round:.0f} "
                      f"tokens read per round before its first new token, one round {path.round_ms:.1f} ms wall, "
                      f"{path.round_cpu_ms:.1f} ms CPU (median)", flush=True)
        backend.close()
    results = {}  # per backend and interval: the run with the median ratio
    for key, found in runs.items():
        found.sort(key=lambda run: run[1].tokens_per_s / run[0].tokens_per_s)
        results[key] = found[(len(found) - 1) // 2]
        if len(found) > 1:
            print(f"{key[0]:10s} {swap_label(*key[1:]):11s} median of {len(found)}: ratio "
                  f"{results[key][1].tokens_per_s / results[key][0].tokens_per_s:.3f}, swap -> first token "
                  f"{results[key][2]:.2f} decode steps (ratios "
                  f"{', '.join(f'{p.tokens_per_s / r.tokens_per_s:.3f}' for r, p, _ in found)})", flush=True)
    names = list(dict.fromkeys(key[0] for key in results))
    main_name = "vllm" if "vllm" in names else names[0]
    main_every, (main_within, main_keep) = swap_everies[0], variants[0]
    reference, path, swap = results[main_name, main_every, main_within, main_keep]
    extra: dict[str, float] = {}
    for (n, every, within, keep), (r, p, s) in results.items():
        if (n, every, within, keep) == (main_name, main_every, main_within, main_keep):
            continue
        key = n.replace("-", "_") + ("" if every == main_every else f"_every_{every}" if every else "_no_swap")
        key += "" if within == main_within else f"_finish_within_{within}"
        key += "" if keep == main_keep else f"_keep_within_{keep}"
        extra[f"{key}_ratio"] = round(p.tokens_per_s / r.tokens_per_s, 3)
        if every:
            extra[f"{key}_swap_decode_steps"] = round(s, 2)
        if n.startswith("hf"):
            extra[f"{key}_round_ms"] = round(p.round_ms, 2)
            extra[f"{key}_tokens_read_per_round"] = round(p.tokens_read_per_round)
    main_variant = (main_every, main_within, main_keep)
    if ("hf", *main_variant) in results and ("hf-nocache", *main_variant) in results:
        cached = results["hf", *main_variant][1]  # the KV cache's gain, same run
        uncached = results["hf-nocache", *main_variant][1]
        print(f"hf worker path: KV cache {cached.tokens_per_s:.0f} tok/s vs re-reading the prefix "
              f"{uncached.tokens_per_s:.0f} tok/s = {cached.tokens_per_s / uncached.tokens_per_s:.2f}x; tokens read "
              f"per round {cached.tokens_read_per_round:.0f} vs {uncached.tokens_read_per_round:.0f}; one round "
              f"{cached.round_ms:.1f} vs {uncached.round_ms:.1f} ms", flush=True)
        extra["hf_kv_cache_speedup"] = round(cached.tokens_per_s / uncached.tokens_per_s, 3)
    report("generation", f"{main_name}_worker_path_tokens_per_s", path.tokens_per_s, "tokens/s",
           reference.tokens_per_s, swap_decode_steps=round(swap, 2), decode_step_ms=round(path.decode_step_ms, 2),
           swap_load_ms=round(statistics.median(path.load_ms or [float("nan")]), 1),
           swap_engine_steps=statistics.median(path.steps_after_load or [float("nan")]),
           tokens_moved_per_swap=round(path.tokens_moved_per_swap), num_swaps=path.num_swaps, leases=args.leases,
           swap_cost_ms=round(statistics.median(path.swap_cost_s or [float("nan")]) * 1e3, 1),
           samples=num_samples, tokens=args.tokens, capacity=args.capacity, swap_every=main_every,
           finish_within_tokens=main_within, keep_version_within=main_keep, lora_rank=16,
           load_average=round(os.getloadavg()[0], 1), **extra)


if __name__ == "__main__":
    main()
