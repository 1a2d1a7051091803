"""The agent gateway's cost: per-request latency and tokens/s through HTTP vs the same engine driven directly.

    .venv/bin/python -m bench.gateway [--backend vllm|hf] [--tokens 32] [--calls 4] [--sessions 1,8,64]
        [--latency-requests 40] [--repeats 3] [--cores shared,split] [--openai-http aiohttp|httpx]

One backend on the tiny model, driven by one engine thread as in a worker; N sessions play ``--calls`` completions
of ``--tokens`` tokens, each prompt the conversation so far plus ``TURN``. ``direct``: the worker's path without
HTTP (vllm: a request per call into the running engine; hf: ``worker.chunk_tokens`` rounds of every sequence).
``gateway``: N recorded sessions (``/sessions/<id>/v1``) of GatewayEngine + GatewayServer in this process, one
``openai.AsyncOpenAI`` per session in a client process; ``plain HTTP``: aiohttp POSTs, without the openai client's
CPU. ``--cores`` (:class:`Placement`) interleave run by run. Value: gateway (openai) / direct tokens/s at the most
sessions in the first placement, reference 0.9 (at most 10 % throughput cost).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench import harness

PROMPT = "12+34="
TURN = "\n56+78="  # what the agent adds after each reply


@dataclass(slots=True, kw_only=True)
class Run:
    """One measured run: tokens/s and where the time went."""

    tok_s: float
    wall_s: float
    rounds: list[int] = field(default_factory=list)  # batch size of each engine round
    generate_cpu_s: float = 0.0  # the engine thread's CPU inside Backend.generate / advance
    core_cpu_s: float = 0.0  # vllm: the engine core process's CPU
    submit_wall_s: float = 0.0  # Backend.submit, wall and CPU (wall - CPU: waits for the GIL or a core)
    submit_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0  # the engine thread's CPU in all (gateway: + admission, calls, replies)
    server_cpu_s: float = 0.0  # the HTTP server thread's CPU
    client_cpu_s: float = 0.0
    num_calls: int = 0
    latencies: list[float] = field(default_factory=list)  # gateway: each call's

    def describe(self) -> str:
        per_call = 1e3 / self.num_calls
        return (f"{self.tok_s:7.0f} tok/s in {self.wall_s:5.2f} s, {len(self.rounds):2d} rounds of mean batch "
                f"{statistics.mean(self.rounds) if self.rounds else 0.0:4.1f} ({self.round_ms:.1f} ms each); CPU: "
                f"generate {self.generate_cpu_s:.2f} s" + (f", engine core {self.core_cpu_s:.2f} s" if self.core_cpu_s
                                                            else "")
                + f", engine thread besides {self.bookkeeping_cpu_s * per_call:.2f} ms/call"
                + (f" (submit: wall {self.submit_wall_s * per_call:.2f}, CPU {self.submit_cpu_s * per_call:.2f} "
                   "ms/call)" if self.submit_wall_s else "")
                + (f", HTTP server {self.server_cpu_s * per_call:.2f} ms/call, clients "
                   f"{self.client_cpu_s * per_call:.2f} ms/call" if self.client_cpu_s else ""))

    @property
    def round_ms(self) -> float:
        return self.wall_s / max(1, len(self.rounds)) * 1e3

    @property
    def worker_cpu_per_token_ms(self) -> float:
        """CPU of the worker's process (engine thread + HTTP server thread) per generated token."""
        return (self.engine_cpu_s + self.server_cpu_s) / max(1.0, self.tok_s * self.wall_s) * 1e3

    @property
    def bookkeeping_cpu_s(self) -> float:
        return max(0.0, self.engine_cpu_s - self.generate_cpu_s)


class BackendCpu:
    """Times the backend's ``generate`` / ``advance`` / ``submit`` (wall, and the calling thread's CPU inside them);
    reads the CPU of its engine processes (vllm's engine core: this process's children at install)."""

    def __init__(self) -> None:
        self.wall_s = {"generate": 0.0, "advance": 0.0, "submit": 0.0}
        self.cpu_s = dict(self.wall_s)
        self.cores: list[Any] = []

    def install(self, backend: Any) -> None:
        import psutil

        self.cores = psutil.Process().children(recursive=True)
        for name in self.wall_s:
            setattr(backend, name, self._timed(name, getattr(backend, name)))

    def _timed(self, name: str, inner: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall_s[name] += time.perf_counter() - wall0
                self.cpu_s[name] += time.thread_time() - cpu0
        return timed

    def now(self) -> dict[str, float]:
        return {"generate_cpu_s": self.cpu_s["generate"] + self.cpu_s["advance"], "submit_wall_s": self.wall_s["submit"],
                "submit_cpu_s": self.cpu_s["submit"], "core_cpu_s": sum(sum(p.cpu_times()[:2]) for p in self.cores)}

    def since(self, before: dict[str, float]) -> dict[str, float]:
        return {k: v - before[k] for k, v in self.now().items()}


BACKEND_CPU = BackendCpu()


def thread_cpu_s(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def direct(backend: Any, chunk: int, sessions: int, tokens: int, calls: int) -> Run:
    """The direct path, ``sessions`` sequences of ``calls`` turns: streaming, each call a request into the running
    engine, the next submitted as soon as one ends; else every live sequence in each chunk round."""
    from loraflow.rollout_worker.backends.base import GenRequest

    generated, rounds = 0, []
    cpu0, before, started = time.thread_time(), BACKEND_CPU.now(), time.perf_counter()
    seqs = [backend.encode(PROMPT) for _ in range(sessions)]
    if backend.streaming:
        outs: list[list[int]] = [[] for _ in range(sessions)]
        left = [calls] * sessions

        def submit(i: int) -> None:
            left[i] -= 1
            backend.submit(f"d{i}/{left[i]}", GenRequest(token_ids=seqs[i], version=0, key=f"d{i}", max_tokens=tokens))

        for i in range(sessions):
            submit(i)
        while backend.num_streams:
            rounds.append(backend.num_streams)
            for delta in backend.advance():
                i = int(delta.request_id[1:].split("/")[0])
                outs[i] += delta.token_ids
                if delta.done:
                    backend.decode(outs[i])
                    seqs[i] = seqs[i] + outs[i] + backend.encode_continuation(TURN)
                    generated += len(outs[i])
                    outs[i] = []
                    if left[i]:
                        submit(i)
    else:
        for _ in range(calls):
            outs, live = [[] for _ in range(sessions)], set(range(sessions))
            while live:
                order = sorted(live)
                rounds.append(len(order))
                results = backend.generate([GenRequest(token_ids=seqs[i] + outs[i], version=0, key=f"d{i}",
                                                       max_tokens=min(chunk, tokens - len(outs[i])),
                                                       num_generated=len(outs[i])) for i in order])
                for i, r in zip(order, results, strict=True):
                    outs[i] += r.token_ids
                    if r.finished or len(outs[i]) >= tokens:
                        live.discard(i)
            for i, ids in enumerate(outs):
                backend.decode(ids)
                seqs[i] += ids + backend.encode_continuation(TURN)
            generated += sum(len(o) for o in outs)
    wall = time.perf_counter() - started
    return Run(tok_s=generated / wall, wall_s=wall, rounds=rounds, engine_cpu_s=time.thread_time() - cpu0,
               num_calls=sessions * calls, **BACKEND_CPU.since(before))


@dataclass(slots=True, kw_only=True)
class Plan:
    """What a client process plays, and the two events that start the clock on both sides."""

    urls: list[str]
    tokens: int
    calls: int
    serial: bool  # one session after another (latency), else all at once
    openai_http: str  # the openai clients' transport: "aiohttp" (the worker's) or "httpx" (openai's default)
    ready: Any  # set by the clients: imported, connected, waiting for ``go``
    go: Any

    async def play(self, call: Any) -> tuple[int, float, list[float], float]:
        """(tokens, seconds, latencies, CPU seconds) of every session's episode once ``go`` is set: ``calls``
        completions, each prompt the conversation so far (``call(url, prompt)`` -> (completion tokens, text))."""
        latencies: list[float] = []

        async def episode(url: str) -> int:
            n, prompt = 0, PROMPT
            for _ in range(self.calls):
                t0 = time.perf_counter()
                num_tokens, text = await call(url, prompt)
                latencies.append(time.perf_counter() - t0)
                n += num_tokens
                prompt += text + TURN
            return n

        self.ready.set()
        await asyncio.to_thread(self.go.wait, 600)
        started, cpu0 = time.perf_counter(), time.process_time()
        work = [episode(url) for url in self.urls]
        counts = await asyncio.gather(*work) if not self.serial else [await w for w in work]
        return sum(counts), time.perf_counter() - started, latencies, time.process_time() - cpu0


def clients(plan: Plan, out: Any, kind: str, cpus: set[int]) -> None:
    """In a child process on ``cpus``: puts :meth:`Plan.play`'s figures on ``out``; ``kind`` "raw": plain aiohttp
    POSTs instead of openai clients."""
    os.sched_setaffinity(0, cpus)
    out.put(asyncio.run(raw_clients(plan) if kind == "raw" else openai_clients(plan)))


async def openai_clients(plan: Plan) -> tuple[int, float, list[float], float]:
    import openai

    async def call(url: str, prompt: str) -> tuple[int, str]:
        reply = await sessions[url].completions.create(model="loraflow", prompt=prompt, max_tokens=plan.tokens)
        return reply.usage.completion_tokens, reply.choices[0].text

    transport = openai.DefaultAioHttpClient if plan.openai_http == "aiohttp" else openai.DefaultAsyncHttpxClient
    sessions = {url: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600,
                                        http_client=transport(verify=False)) for url in plan.urls}
    try:
        await asyncio.gather(*(c.models.list() for c in sessions.values()))  # connections warm
        return await plan.play(call)
    finally:
        await asyncio.gather(*(c.close() for c in sessions.values()))


async def raw_clients(plan: Plan) -> tuple[int, float, list[float], float]:
    import aiohttp

    async def call(url: str, prompt: str) -> tuple[int, str]:
        body = {"model": "loraflow", "prompt": prompt, "max_tokens": plan.tokens}
        async with http.post(f"{url}/v1/completions", json=body) as response:
            reply = await response.json()
        return reply["usage"]["completion_tokens"], reply["choices"][0]["text"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for response in await asyncio.gather(*(http.get(f"{url}/v1/models") for url in plan.urls)):
            response.release()  # connections warm
        return await plan.play(call)


class Gateway:
    """The gateway under test: engine + HTTP server in this process; sessions opened per run."""

    def __init__(self, backend: Any, chunk: int, tokens: int, openai_http: str) -> None:
        from loraflow.common.config import WorkerConfig
        from loraflow.common.metrics import Metrics
        from loraflow.rollout_worker.gateway.engine import GatewayEngine
        from loraflow.rollout_worker.gateway.server import GatewayServer

        self.engine = GatewayEngine(backend, WorkerConfig(chunk_tokens=chunk, max_new_tokens=tokens), max_seq_len=512,
                                    models=["loraflow"], metrics=Metrics(), wake=threading.Event())
        self.server = GatewayServer(self.engine, host="127.0.0.1", port=0, max_request_bytes=1 << 20,
                                    metrics=Metrics()).start()
        self.client_cpus: set[int] = set(os.sched_getaffinity(0))  # set per run (--cores)
        self.openai_http = openai_http
        self._num_runs = 0

    def drive(self, stop: threading.Event, rounds: list[int]) -> None:
        """The worker loop's part, on a thread of its own: pump requests, run a round while any call is in flight
        (its batch size noted in ``rounds``), until ``stop``."""
        while not stop.is_set():
            self.engine.wake.clear()
            self.engine.pump(gather=True)
            if self.engine.calls:
                rounds.append(len(self.engine.calls))
                self.engine.round()
                self.engine.pump()
            else:
                self.engine.wake.wait(0.05)

    def run(self, sessions: int, tokens: int, calls: int, kind: str = "openai", serial: bool = False) -> Run:
        from loraflow.rollout_worker.gateway.session import Session

        self._num_runs += 1
        ids = [f"r{self._num_runs}s{i}" for i in range(sessions)]
        for sid in ids:  # before the engine thread starts: the engine's state is its thread's
            self.engine.open(Session(id=sid))
        ctx, rounds, stop = mp.get_context("spawn"), [], threading.Event()
        out = ctx.Queue()
        plan = Plan(urls=[f"{self.server.url}/sessions/{sid}" for sid in ids], tokens=tokens, calls=calls,
                    serial=serial, openai_http=self.openai_http, ready=ctx.Event(), go=ctx.Event())
        proc = harness.spawn(clients, plan, out, kind, self.client_cpus, daemon=False)
        if not plan.ready.wait(600):
            raise RuntimeError("the client process did not start")
        driver = threading.Thread(target=self.drive, args=(stop, rounds), daemon=True, name="bench-engine")
        driver.start()  # the clients are imported and connected: the clock starts
        server = self.server._thread
        cpu0, server0, before = thread_cpu_s(driver), thread_cpu_s(server), BACKEND_CPU.now()
        plan.go.set()
        num_tokens, elapsed, latencies, client_cpu_s = out.get(timeout=900)
        engine_cpu_s, server_cpu_s = thread_cpu_s(driver) - cpu0, thread_cpu_s(server) - server0
        backend_cpu = BACKEND_CPU.since(before)
        proc.join(30)
        stop.set()
        self.engine.wake.set()
        driver.join()
        for sid in ids:
            self.engine.close(sid)
        return Run(tok_s=num_tokens / elapsed, wall_s=elapsed, rounds=rounds, engine_cpu_s=engine_cpu_s,
                   server_cpu_s=server_cpu_s, client_cpu_s=client_cpu_s, num_calls=sessions * calls,
                   latencies=latencies, **backend_cpu)


class Placement:
    """``--cores``, applied before each run: where the engine side and the clients run, alike for direct and gateway.
    ``shared``: vLLM's model runner where vLLM binds it (on 2 cores CPU 0), all else on every CPU. ``split``: the
    engine side (this process's threads, the HTTP server's included, vLLM's processes) on the model runner's CPUs
    (hf: the first CPU), the clients' process on the others, as on a GPU host."""

    def __init__(self, streaming: bool) -> None:
        import psutil

        self.everything = set(os.sched_getaffinity(0))
        engines = [p for p in BACKEND_CPU.cores if p.is_running()]  # vllm: engine core, model runner
        self.runners = [p for p in engines if set(p.cpu_affinity()) < self.everything]  # bound by vLLM: kept
        self.others = [psutil.Process(), *(p for p in engines if p not in self.runners)]
        self.runner_cpus = {cpu for p in self.runners for cpu in p.cpu_affinity()}
        self.engine_cpus = self.runner_cpus if streaming and self.runner_cpus else {min(self.everything)}
        self.client_cpus = self.everything - self.engine_cpus

    def describe(self, config: str) -> str:
        if config == "shared":
            return f"shared: model runner CPUs {sorted(self.runner_cpus) or 'unbound'}, the rest on all CPUs"
        return f"split: engine side CPUs {sorted(self.engine_cpus)}, clients CPUs {sorted(self.client_cpus)}"

    def state(self) -> str:
        """The CPUs each process's threads may run on now (a check that the placement holds)."""
        out = []
        for proc in [*self.others, *self.runners]:
            with contextlib.suppress(Exception):
                cpus = sorted({tuple(sorted(os.sched_getaffinity(t.id))) for t in proc.threads()})
                out.append(f"{proc.name()}[{proc.pid}] {' '.join(','.join(map(str, c)) for c in cpus)}")
        return "; ".join(out)

    def apply(self, config: str) -> set[int]:
        """Pin the engine side for ``config``; returns the CPUs for the clients' process."""
        if config == "split" and not self.client_cpus:
            raise SystemExit("--cores split needs 2 CPUs or more")
        engine = self.engine_cpus if config == "split" else self.everything
        for proc in self.others:
            for thread in proc.threads():
                with contextlib.suppress(ProcessLookupError):  # a thread that ended since
                    os.sched_setaffinity(thread.id, engine)
        return self.client_cpus if config == "split" else self.everything


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1e3:.1f} ms p99 {harness.pct(values, 0.99) * 1e3:.1f} ms"


def describe_count(n: int, runs: tuple[Run, Run, Run]) -> str:
    d, g, r = runs
    cpu = [x.worker_cpu_per_token_ms for x in runs]
    return (f"{n:3d} sessions: direct  {d.describe()}\n"
            f"              gateway {g.describe()} (openai clients), ratio {g.tok_s / d.tok_s:.3f}\n"
            f"              gateway {r.describe()} (plain HTTP clients), ratio {r.tok_s / d.tok_s:.3f}\n"
            f"              worker CPU per token: direct {cpu[0]:.3f} ms, gateway {cpu[1]:.3f} ms (openai) / "
            f"{cpu[2]:.3f} ms (plain), ratios {cpu[0] / cpu[1]:.3f} / {cpu[0] / cpu[2]:.3f}")


def figures(results: dict[int, tuple[Run, Run, Run]]) -> dict[str, Any]:
    """One placement's figures for the JSON line (per session count: direct, openai, plain)."""
    def each(of: Any) -> dict[str, Any]:
        return {str(n): of(*runs) for n, runs in results.items()}

    def per_call_ms(run: Run, seconds: float) -> float:
        return round(seconds / run.num_calls * 1e3, 3)

    d, g, r = results[max(results)]
    per_call = {"engine_besides_generate": "bookkeeping_cpu_s", "http_server": "server_cpu_s", "clients": "client_cpu_s"}
    return {
        "ratios": each(lambda d, g, r: round(g.tok_s / d.tok_s, 3)),
        "plain_http_ratios": each(lambda d, g, r: round(r.tok_s / d.tok_s, 3)),
        "tok_s_direct_openai_plain": each(lambda *runs: [round(x.tok_s, 1) for x in runs]),
        "worker_cpu_ratios": each(lambda d, *gw: [round(d.worker_cpu_per_token_ms / x.worker_cpu_per_token_ms, 3)
                                                  for x in gw]),
        "rounds_direct_openai_plain": each(lambda *runs: [len(x.rounds) for x in runs]),
        "round_ms_direct_openai_plain": each(lambda *runs: [round(x.round_ms, 2) for x in runs]),
        "engine_steps_ratio_at_top": [round(len(d.rounds) / len(x.rounds), 3) for x in (g, r)],
        "direct_engine_besides_ms_per_call": per_call_ms(d, d.bookkeeping_cpu_s),
        "submit_wall_cpu_ms_per_call_direct_openai_plain": [[per_call_ms(x, x.submit_wall_s),
                                                             per_call_ms(x, x.submit_cpu_s)] for x in (d, g, r)],
        "ms_per_call_at_top": {kind: {k: per_call_ms(x, getattr(x, a)) for k, a in per_call.items()}
                               for kind, x in (("openai", g), ("plain", r))}}


def main() -> None:
    parser = harness.flags(harness.parser(__doc__, repeats=3), {
        "tokens": 32, "calls": 4, "sessions": "1,8,64", "latency_requests": 40, "chunk": 16,
        "cores": ("shared,split", "shared, split, or both (interleaved; the JSON ratio is the first's)")})
    parser.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--openai-http", choices=("aiohttp", "httpx"), default="aiohttp",
                        help="the openai clients' transport (aiohttp: the worker's; httpx: openai's default)")
    args = harness.parse(parser, None, backend="hf", tokens=8, calls=2, sessions="2", latency_requests=2,
                         repeats=1, cores="shared")
    configs = [c for c in args.cores.split(",") if c]
    if not configs or set(configs) - {"shared", "split"}:
        parser.error(f"--cores {args.cores!r}: shared, split or shared,split")
    counts = harness.sizes(args.sessions)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    load_start = harness.load_average()
    import torch

    from loraflow.common.logging import setup_logging

    setup_logging("bench", level="warning")
    torch.set_num_threads(1)
    backend = harness.tiny_backend(args.backend, seed=0, **(dict(max_loras=1, max_lora_rank=8, max_model_len=512,
                                   max_num_seqs=max(64, *counts)) if args.backend == "vllm" else {}))
    BACKEND_CPU.install(backend)
    placement = Placement(backend.streaming)
    gateway = Gateway(backend, args.chunk, args.tokens, args.openai_http)
    direct(backend, args.chunk, 2, args.tokens, 2)  # warm-up
    print(f"backend {args.backend} ({'streaming' if backend.streaming else f'chunk {args.chunk}'}); "
          f"{args.calls} calls of {args.tokens} tokens per session; load average at the start {load_start}; "
          f"cores: {'; '.join(placement.describe(c) for c in configs)}", flush=True)

    # latency: one request at a time, in the first placement
    gateway.client_cpus = placement.apply(configs[0])
    direct_lat = [direct(backend, args.chunk, 1, args.tokens, 1).wall_s for _ in range(args.latency_requests)]
    gateway_lat = gateway.run(args.latency_requests, args.tokens, 1, serial=True).latencies
    print(f"latency ({configs[0]}), 1 session, {args.tokens} tokens: direct {ms(direct_lat)} | gateway {ms(gateway_lat)}"
          f" | overhead median {(statistics.median(gateway_lat) - statistics.median(direct_lat)) * 1e3:.1f} ms")

    shown: set[str] = set()

    def placed(config: str, n: int) -> tuple[Run, Run, Run]:
        """Direct, gateway (openai clients) and gateway (plain HTTP) at ``n`` sessions in placement ``config``."""
        gateway.client_cpus = placement.apply(config)
        if config not in shown:
            shown.add(config)
            print(f"[{config} cores] threads' CPUs: {placement.state()}; clients: "
                  f"{','.join(map(str, sorted(gateway.client_cpus)))}", flush=True)
        return (direct(backend, args.chunk, n, args.tokens, args.calls), gateway.run(n, args.tokens, args.calls),
                gateway.run(n, args.tokens, args.calls, "raw"))

    results: dict[str, dict[int, tuple[Run, Run, Run]]] = {c: {} for c in configs}
    for n in counts:
        runs = harness.interleave({c: lambda c=c, n=n: placed(c, n) for c in configs}, args.repeats)
        for config in configs:
            by_kind = zip(*runs[config], strict=True)  # the median run by tok/s of direct, openai, plain
            results[config][n] = d, g, r = tuple(sorted(x, key=lambda run: run.tok_s)[len(x) // 2] for x in by_kind)
            print(f"[{config} cores] {describe_count(n, (d, g, r))}")
        print(f"load average {harness.load_average()}", flush=True)
    gateway.server.close()
    backend.close()
    top = max(counts)
    ratio, plain = ({c: results[c][top][k].tok_s / results[c][top][0].tok_s for c in configs} for k in (1, 2))
    print(f"at {top} sessions, gateway / direct tok/s: " + "; ".join(
        f"{c} cores {ratio[c]:.3f} (openai clients), {plain[c]:.3f} (plain HTTP)" for c in configs))
    d, g, _ = results[configs[0]][top]
    harness.report("gateway", f"tokens_per_s_ratio_at_{top}_sessions", ratio[configs[0]], "ratio", 0.9,
                   ratio=ratio[configs[0]], cores=configs[0], gateway_tok_s=round(g.tok_s, 1),
                   direct_tok_s=round(d.tok_s, 1), ratio_by_cores={c: round(x, 4) for c, x in ratio.items()},
                   plain_http_ratio_by_cores={c: round(x, 4) for c, x in plain.items()},
                   backend=args.backend, openai_http=args.openai_http, load_average_start=load_start,
                   load_average_end=harness.load_average(), latency_median_ms=round(statistics.median(gateway_lat) * 1e3, 2),
                   latency_p99_ms=round(harness.pct(gateway_lat, 0.99) * 1e3, 2),
                   direct_latency_median_ms=round(statistics.median(direct_lat) * 1e3, 2),
                   direct_latency_p99_ms=round(harness.pct(direct_lat, 0.99) * 1e3, 2),
                   by_cores={c: figures(results[c]) for c in configs})


if __name__ == "__main__":
    main()
