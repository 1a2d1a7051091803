"""The agent gateway's cost: per-request latency and tokens/s through HTTP vs the same engine driven directly.

    .venv/bin/python -m bench.gateway [--tokens 32] [--calls 4] [--sessions 1,8,64] [--latency-requests 40]
                                      [--repeats 3]

One hf backend on the tiny model (one torch thread), one engine thread owning it, as in a worker:

- ``direct``: the worker's own path without HTTP: ``N`` sequences, each encoded from its prompt, generated in
  ``worker.chunk_tokens`` rounds that batch every sequence (one ``Backend.generate`` per round) until each has
  ``--tokens`` tokens, decoded; ``--calls`` such calls per sequence, one after another;
- ``gateway``: ``N`` concurrent sessions, each an ``openai.AsyncOpenAI`` client in a separate client process
  making ``--calls`` completion calls of ``--tokens`` tokens one after another through the gateway
  (GatewayEngine + GatewayServer, the engine pumped and rounded by the engine thread as the worker loop does).

Each count is also run with plain aiohttp POSTs as the clients (``plain HTTP``), which takes the openai
client's own CPU (pydantic models, httpx) out of the figure: on a 2-core machine the client process competes
with the engine for the same cores.

Latency: one session, one request of ``--tokens`` tokens at a time, median and p99 of the gateway's
end-to-end time (client to reply), next to the direct call's. Throughput runs alternate direct and gateway
``--repeats`` times per session count and report the medians. Tokens/s counts the tokens
actually generated (a sequence may end early at EOS). The JSON line's value is gateway / direct tokens/s at the
largest session count, reference 0.9 (the target: at most 10 % throughput cost at 64 sessions).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import threading
import time
from typing import Any

PROMPT = "12+34="


def drive(engine: Any, stop: threading.Event) -> None:
    """The worker loop's part: pump requests, run chunk rounds while any call is in flight."""
    while not stop.is_set():
        engine.wake.clear()
        engine.pump(gather=True)
        if engine.calls:
            engine.round()
            engine.pump()
        else:
            engine.wake.wait(0.05)


def direct(backend: Any, chunk: int, sessions: int, tokens: int, calls: int) -> tuple[float, list[float]]:
    """(tokens/s, per-call latencies) of the direct path."""
    from rollout_worker.backends.base import GenRequest

    generated, latencies = 0, []
    started = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        prompts = [backend.encode(PROMPT) for _ in range(sessions)]
        outs: list[list[int]] = [[] for _ in range(sessions)]
        live = set(range(sessions))
        while live:
            order = sorted(live)
            results = backend.generate([GenRequest(token_ids=prompts[i] + outs[i], version=0, key=f"d{i}",
                                                   max_tokens=min(chunk, tokens - len(outs[i])),
                                                   num_generated=len(outs[i])) for i in order])
            for i, r in zip(order, results, strict=True):
                outs[i] += r.token_ids
                if r.finished or len(outs[i]) >= tokens:
                    live.discard(i)
        for ids in outs:
            backend.decode(ids)
        generated += sum(len(o) for o in outs)
        latencies.append(time.perf_counter() - t0)
    return generated / (time.perf_counter() - started), latencies


def clients(url: str, sessions: int, tokens: int, calls: int, out: Any, kind: str = "openai") -> None:
    """In a child process: ``sessions`` concurrent clients, ``calls`` completions each; puts (tokens, elapsed,
    latencies) on ``out``. ``kind`` "raw": plain aiohttp POSTs instead of the openai client (its own CPU cost
    out of the picture)."""
    if kind == "raw":
        out.put(asyncio.run(raw_clients(url, sessions, tokens, calls)))
        return
    import openai

    async def one(client: Any, latencies: list[float]) -> int:
        n = 0
        for _ in range(calls):
            t0 = time.perf_counter()
            reply = await client.completions.create(model="loraflow", prompt=PROMPT, max_tokens=tokens)
            latencies.append(time.perf_counter() - t0)
            n += reply.usage.completion_tokens
        return n

    async def main() -> tuple[int, float, list[float]]:
        latencies: list[float] = []
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600) as client:
            await client.models.list()  # connection warm
            started = time.perf_counter()
            counts = await asyncio.gather(*(one(client, latencies) for _ in range(sessions)))
            return sum(counts), time.perf_counter() - started, latencies

    out.put(asyncio.run(main()))


async def raw_clients(url: str, sessions: int, tokens: int, calls: int) -> tuple[int, float, list[float]]:
    import aiohttp

    body = {"model": "loraflow", "prompt": PROMPT, "max_tokens": tokens}
    latencies: list[float] = []

    async def one(http: Any) -> int:
        n = 0
        for _ in range(calls):
            t0 = time.perf_counter()
            async with http.post(f"{url}/v1/completions", json=body) as response:
                n += (await response.json())["usage"]["completion_tokens"]
            latencies.append(time.perf_counter() - t0)
        return n

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(http) for _ in range(sessions)))
        return sum(counts), time.perf_counter() - started, latencies


def through_gateway(url: str, sessions: int, tokens: int, calls: int, kind: str = "openai") -> tuple[float, list[float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=clients, args=(url, sessions, tokens, calls, out, kind))
    proc.start()
    num_tokens, elapsed, latencies = out.get(timeout=900)
    proc.join(30)
    return num_tokens / elapsed, latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--sessions", default="1,8,64")
    parser.add_argument("--latency-requests", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved direct/gateway runs per count (median)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from bench.report import report
    from common.config import WorkerConfig
    from common.metrics import Metrics
    from common.tiny_model import resolve_model
    from rollout_worker.backends.base import Sampling
    from rollout_worker.backends.hf import HfBackend
    from rollout_worker.gateway.engine import GatewayEngine
    from rollout_worker.gateway.server import GatewayServer

    backend = HfBackend(resolve_model("builtin:tiny"), sampling=Sampling(), device="cpu", seed=0)
    config = WorkerConfig(chunk_tokens=args.chunk, max_new_tokens=args.tokens)
    wake = threading.Event()
    engine = GatewayEngine(backend, config, max_seq_len=512, models=["loraflow"], metrics=Metrics(), wake=wake)
    engine.wake = wake
    server = GatewayServer(engine, host="127.0.0.1", port=0, max_request_bytes=1 << 20, metrics=Metrics()).start()
    stop = threading.Event()
    direct(backend, args.chunk, 1, args.tokens, 2)  # warm-up

    # latency: one request at a time
    _, direct_lat = direct(backend, args.chunk, 1, args.tokens, args.latency_requests)
    thread = threading.Thread(target=drive, args=(engine, stop), daemon=True)
    thread.start()
    _, gateway_lat = through_gateway(server.url, 1, args.tokens, args.latency_requests)
    print(f"latency, 1 session, {args.tokens} tokens: direct median {statistics.median(direct_lat) * 1e3:.1f} ms "
          f"p99 {pct(direct_lat, 0.99) * 1e3:.1f} ms | gateway median {statistics.median(gateway_lat) * 1e3:.1f} ms "
          f"p99 {pct(gateway_lat, 0.99) * 1e3:.1f} ms | overhead median "
          f"{(statistics.median(gateway_lat) - statistics.median(direct_lat)) * 1e3:.1f} ms")

    rates, raw = {}, {}
    for n in [int(x) for x in args.sessions.split(",")]:
        d_rates, g_rates, r_rates = [], [], []
        for _ in range(args.repeats):  # interleaved: a shared machine's load hits both alike
            stop.set()
            thread.join()
            d_rates.append(direct(backend, args.chunk, n, args.tokens, args.calls)[0])
            stop.clear()
            thread = threading.Thread(target=drive, args=(engine, stop), daemon=True)
            thread.start()
            g_rates.append(through_gateway(server.url, n, args.tokens, args.calls)[0])
            r_rates.append(through_gateway(server.url, n, args.tokens, args.calls, "raw")[0])
        d_rate, g_rate, r_rate = (statistics.median(x) for x in (d_rates, g_rates, r_rates))
        rates[n] = (d_rate, g_rate)
        raw[n] = r_rate / d_rate
        print(f"{n:3d} sessions: direct {d_rate:8.0f} tok/s | gateway {g_rate:8.0f} tok/s (openai clients), ratio "
              f"{g_rate / d_rate:.3f} | {r_rate:8.0f} tok/s (plain HTTP clients), ratio {r_rate / d_rate:.3f}")
    stop.set()
    thread.join()
    server.close()
    top = max(rates)
    d_rate, g_rate = rates[top]
    report("gateway", f"tokens_per_s_ratio_at_{top}_sessions", g_rate / d_rate, "ratio", 0.9, ratio=g_rate / d_rate,
           gateway_tok_s=round(g_rate, 1), direct_tok_s=round(d_rate, 1),
           latency_median_ms=round(statistics.median(gateway_lat) * 1e3, 2),
           latency_p99_ms=round(pct(gateway_lat, 0.99) * 1e3, 2),
           direct_latency_median_ms=round(statistics.median(direct_lat) * 1e3, 2),
           direct_latency_p99_ms=round(pct(direct_lat, 0.99) * 1e3, 2),
           ratios={str(n): round(g / d, 3) for n, (d, g) in rates.items()},
           plain_http_ratios={str(n): round(r, 3) for n, r in raw.items()})


if __name__ == "__main__":
    main()
