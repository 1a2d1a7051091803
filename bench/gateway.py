"""The agent gateway's cost: per-request latency and tokens/s through HTTP vs the same engine driven directly.

    .venv/bin/python -m bench.gateway [--backend vllm] [--tokens 32] [--calls 4] [--sessions 1,8,64]
                                      [--latency-requests 40] [--repeats 3] [--cores shared,split] [--burn 0.2]
                                      [--openai-http aiohttp|httpx] [--profile]

One backend on the tiny model, one engine thread owning it, as in a worker: ``vllm`` (the default; vLLM's CPU
engine, its engine core in a process of its own, fed continuously: ``Backend.submit`` / ``advance``) or ``hf``
(one torch thread, chunk rounds of ``Backend.generate``). Each of ``N`` sessions plays an episode of ``--calls``
text completions of ``--tokens`` tokens, each call's prompt the whole conversation so far (the previous prompt,
the text the model returned, a new turn ``TURN``), as an agent sends it:

- ``direct``: the worker's own path without HTTP: ``N`` sequences, each call decoded and the turn's tokens
  appended. vllm: as the rollouts stream (rollout_worker/rollout.py), each sequence's call is one request
  submitted into the running engine, and its next call is submitted as soon as it ends; hf: generated in
  ``worker.chunk_tokens`` rounds that batch every sequence (one ``Backend.generate`` per round);
- ``gateway``: ``N`` concurrent recorded sessions (``/sessions/<id>/v1``: trajectory, prefix check), each with an
  ``openai.AsyncOpenAI`` client of its own on openai's aiohttp transport, as the worker gives each episode
  (``loraflow.rollout_worker.gateway.episodes``; ``--openai-http httpx``: openai's default transport instead),
  in a client process (GatewayEngine + GatewayServer in this one, the engine pumped and rounded by the engine
  thread as the worker loop does). Each count also runs with plain aiohttp POSTs as the clients
  (``plain HTTP``), which leaves out the openai client's own CPU (its transport, pydantic).

The clients' own CPU is the harness's, not the gateway's; on a 2-core machine it still competes with the engine.
``--cores`` says where things run (:class:`Placement`), the same for direct and gateway; both placements by
default, interleaved run by run:

- ``shared`` (the JSON line's ``ratio``): as a worker runs on this machine: vLLM binds its model runner to CPU 0
  (its ``auto`` binding; ``VLLM_CPU_OMP_THREADS_BIND`` is left unset, so direct and gateway share one engine
  and one binding), everything else (this process, vLLM's engine core, the clients) on both CPUs;
- ``split``: as on a GPU host, where the harness has cores of its own: the engine side on CPU 0 (this process's
  threads, the gateway's HTTP server thread among them, so its cost still counts; vLLM's engine core and model
  runner), the clients' process on CPU 1. Printed beside the shared figure and in the JSON line
  (``ratio_by_cores``, ``by_cores``). On a loaded machine another process on CPU 0 slows both sides alike.

On the random tiny model the sampled bytes often re-encode otherwise (invalid UTF-8, special ids), so most
calls after the first take the prefix check's divergence path (``tito_divergence{reason="tokens"}``): the
check's slower case is what is measured.

Per run it prints where the time goes: the number of rounds (vllm: engine steps taken, ``Backend.advance``;
hf: chunk rounds) and their mean batch (requests in the engine; hf direct: every sequence in every round), and the
CPU split: the engine thread inside ``Backend.generate`` / ``advance``, the engine thread besides it
(admission: rendering, encoding, the prefix check; a call's bookkeeping and reply), the HTTP server thread (HTTP,
JSON, request checks), the client process, per call, and (vllm) the engine core process. ``worker CPU per token`` (engine + server threads, the
worker's process) direct / gateway is the gateway's cost that a loaded machine distorts least: on a shared machine
the wall-clock ratio also measures how the scheduler shares the cores between one process (direct) and two
(gateway + clients), which favours the gateway.

Latency: ``--latency-requests`` sessions one after another, one request of ``--tokens`` tokens each, median and
p99 of the gateway's end-to-end time (client to reply), next to the direct call's. Throughput runs alternate
direct and gateway ``--repeats`` times per session count and report the medians (the run of median tokens/s). Tokens/s counts the tokens actually generated
(a sequence may end early at EOS). The JSON line's value is gateway (openai clients) / direct tokens/s at the
largest session count in the first ``--cores`` placement (``cores``; shared by default), reference 0.9 (the
target: at most 10 % throughput cost at 64 sessions); the load average at the start and end goes with it.
``--profile`` prints where the engine and HTTP server threads' CPU goes (cProfile on each thread's CPU clock).

``--burn F`` is a control for a machine without spare cores: direct is run again beside a process that keeps
``F`` of a core busy in 1 ms slices, about the CPU the clients and the HTTP server take (no gateway involved), so
the share of the gateway's cost that is only CPU taken from the engine shows (``burned_direct_ratios``).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
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
    rounds: list[int] = field(default_factory=list)  # batch size of each chunk round
    generate_cpu_s: float = 0.0  # the engine thread's CPU inside Backend.generate / advance
    core_cpu_s: float = 0.0  # vllm: the engine core process's CPU
    submit_wall_s: float = 0.0  # vllm: Backend.submit, wall and CPU (wall - CPU: waits for the GIL or a core)
    submit_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0  # the engine thread's CPU in all (gateway: + admission, calls, replies)
    server_cpu_s: float = 0.0  # the HTTP server thread's CPU (gateway: HTTP, JSON, request checks)
    client_cpu_s: float = 0.0
    num_calls: int = 0
    latencies: list[float] = field(default_factory=list)

    def describe(self) -> str:
        batch = statistics.mean(self.rounds) if self.rounds else 0.0
        per_call = 1e3 / self.num_calls
        text = f"{self.tok_s:7.0f} tok/s in {self.wall_s:5.2f} s, {len(self.rounds):2d} rounds of mean batch " \
               f"{batch:4.1f} ({self.round_ms:.1f} ms each); CPU: generate {self.generate_cpu_s:.2f} s"
        if self.core_cpu_s:
            text += f", engine core {self.core_cpu_s:.2f} s"
        text += f", engine thread besides {self.bookkeeping_cpu_s * per_call:.2f} ms/call"
        if self.submit_wall_s:
            text += f" (submit: wall {self.submit_wall_s * per_call:.2f}, CPU {self.submit_cpu_s * per_call:.2f} ms/call)"
        if self.client_cpu_s:
            text += f", HTTP server {self.server_cpu_s * per_call:.2f} ms/call, clients " \
                    f"{self.client_cpu_s * per_call:.2f} ms/call"
        return text

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


class GenerateCpu:
    """Wraps ``backend.generate`` and ``backend.advance``: the CPU seconds of the calling thread inside them,
    summed; and the CPU of the backend's engine processes (vllm's engine core: the children of this process
    when the backend was made)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.submit_wall_s = self.submit_cpu_s = 0.0  # Backend.submit (streaming): wall and CPU of the caller
        self.cores: list[Any] = []

    def install(self, backend: Any) -> None:
        import psutil

        self.cores = psutil.Process().children(recursive=True)
        for name in ("generate", "advance"):
            setattr(backend, name, self._timed(getattr(backend, name)))
        inner = backend.submit

        def submit(*args: Any, **kwargs: Any) -> Any:
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.submit_wall_s += time.perf_counter() - wall0
                self.submit_cpu_s += time.thread_time() - cpu0

        backend.submit = submit

    def _timed(self, inner: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            cpu0 = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - cpu0
        return timed

    def submits(self) -> tuple[float, float]:
        return self.submit_wall_s, self.submit_cpu_s

    def core_cpu_s(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.cores)


GENERATE_CPU = GenerateCpu()


def thread_cpu_s(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class ThreadProfiles:
    """``--profile``: cProfile of the gateway's engine thread and HTTP server thread, each timed by its own
    thread's CPU clock (so waits cost nothing), summed over the gateway runs and printed at the end."""

    def __init__(self) -> None:
        import cProfile

        self.engine = cProfile.Profile(time.thread_time)
        self.server = cProfile.Profile(time.thread_time)

    def print(self, num_calls: int, top: int = 25) -> None:
        import io
        import pstats

        for name, prof in (("engine thread", self.engine), ("HTTP server thread", self.server)):
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            print(f"profile, {name}: {stats.total_tt / max(1, num_calls) * 1e3:.3f} ms CPU per call over "
                  f"{num_calls} calls; top by own time:")
            stats.sort_stats("tottime").print_stats(top)
            print("\n".join(out.getvalue().splitlines()[-top - 2:]))
            out.seek(0), out.truncate()
            stats.sort_stats("cumulative").print_stats(r"gateway/|common/chat|backends/")
            print(f"profile, {name}: the gateway's, chat's and backends' functions by cumulative time:")
            print("\n".join(line for line in out.getvalue().splitlines() if "/work/" in line or "ncalls" in line))


class Driver:
    """The worker loop's part on a thread of its own: pump requests, run chunk rounds while any call is in
    flight; notes each round's batch size."""

    def __init__(self, engine: Any, profile: Any = None) -> None:
        self.engine = engine
        self.profile = profile
        self.stop = threading.Event()
        self.rounds: list[int] = []
        self.thread = threading.Thread(target=self._loop, daemon=True, name="bench-engine")
        self.thread.start()

    def _loop(self) -> None:
        if self.profile is None:
            return self._run()
        self.profile.enable()
        try:
            return self._run()
        finally:
            self.profile.disable()

    def _run(self) -> None:
        engine = self.engine
        while not self.stop.is_set():
            engine.wake.clear()
            engine.pump(gather=True)
            if engine.calls:
                self.rounds.append(len(engine.calls))
                engine.round()
                engine.pump()
            else:
                engine.wake.wait(0.05)

    def close(self) -> None:
        self.stop.set()
        self.engine.wake.set()
        self.thread.join()


def direct(backend: Any, chunk: int, sessions: int, tokens: int, calls: int) -> Run:
    """The direct path: ``sessions`` sequences, ``calls`` turns each; streaming, each call a request into the
    running engine; else all sequences in every chunk round."""
    if backend.streaming:
        return direct_stream(backend, sessions, tokens, calls)
    from loraflow.rollout_worker.backends.base import GenRequest

    generated, latencies, rounds = 0, [], []
    cpu0, generate0, started = time.thread_time(), GENERATE_CPU.seconds, time.perf_counter()
    core0 = GENERATE_CPU.core_cpu_s()
    seqs = [backend.encode(PROMPT) for _ in range(sessions)]
    for _ in range(calls):
        t0 = time.perf_counter()
        outs: list[list[int]] = [[] for _ in range(sessions)]
        live = set(range(sessions))
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
        latencies.append(time.perf_counter() - t0)
    wall = time.perf_counter() - started
    return Run(tok_s=generated / wall, wall_s=wall, rounds=rounds, generate_cpu_s=GENERATE_CPU.seconds - generate0,
               engine_cpu_s=time.thread_time() - cpu0, core_cpu_s=GENERATE_CPU.core_cpu_s() - core0,
               num_calls=sessions * calls, latencies=latencies)


def direct_stream(backend: Any, sessions: int, tokens: int, calls: int) -> Run:
    """The rollouts' streaming path: each sequence's call one request in the running engine, the next call
    submitted as soon as one ends (its text decoded, the turn appended)."""
    from loraflow.rollout_worker.backends.base import GenRequest

    generated, latencies, rounds = 0, [], []
    cpu0, generate0, started = time.thread_time(), GENERATE_CPU.seconds, time.perf_counter()
    core0, (sub_wall0, sub_cpu0) = GENERATE_CPU.core_cpu_s(), GENERATE_CPU.submits()
    seqs = [backend.encode(PROMPT) for _ in range(sessions)]
    outs: list[list[int]] = [[] for _ in range(sessions)]
    left, since = [calls] * sessions, [0.0] * sessions

    def submit(i: int) -> None:
        left[i] -= 1
        since[i] = time.perf_counter()
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
                latencies.append(time.perf_counter() - since[i])
                if left[i]:
                    submit(i)
    wall = time.perf_counter() - started
    sub_wall, sub_cpu = GENERATE_CPU.submits()
    return Run(tok_s=generated / wall, wall_s=wall, rounds=rounds, generate_cpu_s=GENERATE_CPU.seconds - generate0,
               engine_cpu_s=time.thread_time() - cpu0, core_cpu_s=GENERATE_CPU.core_cpu_s() - core0,
               submit_wall_s=sub_wall - sub_wall0, submit_cpu_s=sub_cpu - sub_cpu0,
               num_calls=sessions * calls, latencies=latencies)


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

    async def start(self) -> float:
        self.ready.set()
        await asyncio.to_thread(self.go.wait, 600)
        return time.perf_counter()


def clients(plan: Plan, out: Any, kind: str, cpus: set[int] | None) -> None:
    """In a child process: one client per session URL, ``calls`` completions each; puts (tokens, elapsed,
    latencies, CPU seconds of the measured window) on ``out``. ``kind`` "raw": plain aiohttp POSTs instead of
    openai clients."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    run = raw_clients if kind == "raw" else openai_clients
    out.put(asyncio.run(run(plan)))


async def together(plan: Plan, work: list[Any]) -> tuple[int, float, float]:
    """(tokens, seconds, CPU seconds) of the sessions' work, all at once or one after another."""
    started, cpu0 = await plan.start(), time.process_time()
    counts = await asyncio.gather(*work) if not plan.serial else [await w for w in work]
    return sum(counts), time.perf_counter() - started, time.process_time() - cpu0


async def openai_clients(plan: Plan) -> tuple[int, float, list[float], float]:
    import openai

    latencies: list[float] = []

    async def one(client: Any) -> int:
        n, prompt = 0, PROMPT
        for _ in range(plan.calls):
            t0 = time.perf_counter()
            reply = await client.completions.create(model="loraflow", prompt=prompt, max_tokens=plan.tokens)
            latencies.append(time.perf_counter() - t0)
            n += reply.usage.completion_tokens
            prompt += reply.choices[0].text + TURN
        return n

    # one client per session, as the worker gives each episode (loraflow.rollout_worker.gateway.episodes)
    transport = openai.DefaultAioHttpClient if plan.openai_http == "aiohttp" else openai.DefaultAsyncHttpxClient
    sessions = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600,
                                   http_client=transport(verify=False)) for url in plan.urls]
    try:
        await asyncio.gather(*(c.models.list() for c in sessions))  # connections warm
        num_tokens, elapsed, cpu_s = await together(plan, [one(c) for c in sessions])
        return num_tokens, elapsed, latencies, cpu_s
    finally:
        await asyncio.gather(*(c.close() for c in sessions))


async def raw_clients(plan: Plan) -> tuple[int, float, list[float], float]:
    import aiohttp

    latencies: list[float] = []

    async def one(http: Any, url: str) -> int:
        n, prompt = 0, PROMPT
        for _ in range(plan.calls):
            t0 = time.perf_counter()
            body = {"model": "loraflow", "prompt": prompt, "max_tokens": plan.tokens}
            async with http.post(f"{url}/v1/completions", json=body) as response:
                reply = await response.json()
            latencies.append(time.perf_counter() - t0)
            n += reply["usage"]["completion_tokens"]
            prompt += reply["choices"][0]["text"] + TURN
        return n

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for response in await asyncio.gather(*(http.get(f"{url}/v1/models") for url in plan.urls)):
            response.release()  # connections warm
        num_tokens, elapsed, cpu_s = await together(plan, [one(http, url) for url in plan.urls])
        return num_tokens, elapsed, latencies, cpu_s


class Gateway:
    """The gateway under test: engine + HTTP server in this process; sessions opened per run."""

    def __init__(self, backend: Any, chunk: int, tokens: int, profile: ThreadProfiles | None = None,
                 openai_http: str = "aiohttp") -> None:
        from loraflow.common.config import WorkerConfig
        from loraflow.common.metrics import Metrics
        from loraflow.rollout_worker.gateway.engine import GatewayEngine
        from loraflow.rollout_worker.gateway.server import GatewayServer

        config = WorkerConfig(chunk_tokens=chunk, max_new_tokens=tokens)
        self.engine = GatewayEngine(backend, config, max_seq_len=512, models=["loraflow"], metrics=Metrics(),
                                    wake=threading.Event())
        self.server = GatewayServer(self.engine, host="127.0.0.1", port=0, max_request_bytes=1 << 20,
                                    metrics=Metrics()).start()
        self.client_cpus: set[int] | None = None  # set per run (--cores)
        self.openai_http = openai_http  # the openai clients' transport (Plan.openai_http)
        self.profile = profile
        self.num_profiled_calls = 0
        self._num_runs = 0

    def run(self, sessions: int, tokens: int, calls: int, kind: str = "openai", serial: bool = False) -> Run:
        from loraflow.rollout_worker.gateway.session import Session

        self._num_runs += 1
        ids = [f"r{self._num_runs}s{i}" for i in range(sessions)]
        for sid in ids:  # before the engine thread starts: the engine's state is its thread's
            self.engine.open(Session(id=sid))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        plan = Plan(urls=[f"{self.server.url}/sessions/{sid}" for sid in ids], tokens=tokens, calls=calls,
                    serial=serial, openai_http=self.openai_http, ready=ctx.Event(), go=ctx.Event())
        proc = ctx.Process(target=clients, args=(plan, out, kind, self.client_cpus))
        proc.start()
        if not plan.ready.wait(600):
            raise RuntimeError("the client process did not start")
        profile = self.profile if not serial else None
        if profile is not None:  # on the server's own thread (cProfile profiles the thread that enables it)
            self.server.loop.call_soon_threadsafe(profile.server.enable)
            self.num_profiled_calls += sessions * calls
        driver = Driver(self.engine, profile.engine if profile is not None else None)  # the clients are
        # imported and connected: the clock starts
        cpu0, server0, generate0 = thread_cpu_s(driver.thread), self.server_cpu_s(), GENERATE_CPU.seconds
        core0, (sub_wall0, sub_cpu0) = GENERATE_CPU.core_cpu_s(), GENERATE_CPU.submits()
        plan.go.set()
        num_tokens, elapsed, latencies, client_cpu_s = out.get(timeout=900)
        engine_cpu_s, server_cpu_s = thread_cpu_s(driver.thread) - cpu0, self.server_cpu_s() - server0
        generate_cpu_s, core_cpu_s = GENERATE_CPU.seconds - generate0, GENERATE_CPU.core_cpu_s() - core0
        sub_wall, sub_cpu = GENERATE_CPU.submits()
        proc.join(30)
        driver.close()
        if profile is not None:
            asyncio.run_coroutine_threadsafe(_call(profile.server.disable), self.server.loop).result(10)
        for sid in ids:
            self.engine.close(sid)
        return Run(tok_s=num_tokens / elapsed, wall_s=elapsed, rounds=driver.rounds, generate_cpu_s=generate_cpu_s,
                   core_cpu_s=core_cpu_s, submit_wall_s=sub_wall - sub_wall0, submit_cpu_s=sub_cpu - sub_cpu0,
                   engine_cpu_s=engine_cpu_s, server_cpu_s=server_cpu_s, client_cpu_s=client_cpu_s,
                   num_calls=sessions * calls, latencies=latencies)

    def server_cpu_s(self) -> float:
        return thread_cpu_s(self.server._thread)

    def close(self) -> None:
        self.server.close()


async def _call(fn: Any) -> None:
    fn()


def burn(fraction: float, stop: Any) -> None:
    """In a child process: keep ``fraction`` of one core busy, in 1 ms slices, until ``stop`` is set."""
    while not stop.is_set():
        until = time.perf_counter() + 1e-3
        while time.perf_counter() < until:
            pass
        time.sleep(1e-3 * (1 - fraction) / fraction)


def direct_burned(backend: Any, fraction: float, *args: Any) -> Run:
    """The direct path while a side process keeps ``fraction`` of a core busy (``--burn``)."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    proc = ctx.Process(target=burn, args=(fraction, stop))
    proc.start()
    try:
        time.sleep(0.5)  # started
        return direct(backend, *args)
    finally:
        stop.set()
        proc.join(30)


class Placement:
    """``--cores``: where the engine side and the clients run, the same for direct and gateway.

    ``shared``: as a worker runs on this machine: vLLM binds its model runner to the CPUs of its choice
    (``VLLM_CPU_OMP_THREADS_BIND`` unset: vLLM's ``auto``, on 2 cores the model runner on CPU 0, one CPU left for
    the rest), everything else (this process: the direct run, the engine thread, the HTTP server thread; vLLM's
    engine core; the clients) on every CPU. ``split``: as on a GPU host, where the harness has cores of its
    own: the engine side (this process's threads, the HTTP server's included, and vLLM's processes) on the model
    runner's CPUs, the clients' process on the others (on 2 cores: CPU 0 and CPU 1). hf: the engine side on
    the first CPU. Applied before each run (threads started since, tokenizers' pools among them, follow)."""

    def __init__(self, streaming: bool) -> None:
        import psutil

        self.everything = set(os.sched_getaffinity(0))
        engines = [p for p in GENERATE_CPU.cores if p.is_running()]  # vllm: engine core, model runner
        self.runners = [p for p in engines if set(p.cpu_affinity()) < self.everything]  # bound by vLLM: kept
        self.others = [psutil.Process(), *(p for p in engines if p not in self.runners)]
        runner = {cpu for p in self.runners for cpu in p.cpu_affinity()}
        self.engine_cpus = runner if streaming and runner else {min(self.everything)}
        self.client_cpus = self.everything - self.engine_cpus

    def describe(self, config: str) -> str:
        if config == "shared":
            runner = sorted({cpu for p in self.runners for cpu in p.cpu_affinity()})
            return f"shared: model runner CPUs {runner or 'unbound'}, the rest on all CPUs"
        return f"split: engine side CPUs {sorted(self.engine_cpus)}, clients CPUs {sorted(self.client_cpus)}"

    def state(self) -> str:
        """The CPUs each process's threads may run on now (a check that the placement holds)."""
        out = []
        for proc in [*self.others, *self.runners]:
            with contextlib.suppress(Exception):
                cpus = sorted({tuple(sorted(os.sched_getaffinity(t.id))) for t in proc.threads()})
                out.append(f"{proc.name()}[{proc.pid}] {' '.join(','.join(map(str, c)) for c in cpus)}")
        return "; ".join(out)

    def apply(self, config: str) -> set[int] | None:
        """Pin the engine side for ``config``; returns the CPUs for the clients' process."""
        if config == "split" and not self.client_cpus:
            raise SystemExit("--cores split needs 2 CPUs or more")
        engine = self.engine_cpus if config == "split" else self.everything
        for proc in self.others:
            for thread in proc.threads():
                with contextlib.suppress(ProcessLookupError):  # a thread that ended since
                    os.sched_setaffinity(thread.id, engine)
        return self.client_cpus if config == "split" else self.everything


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.tok_s)[len(runs) // 2]


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def describe_count(n: int, runs: tuple[Run, Run, Run]) -> str:
    d, g, r = runs
    return (f"{n:3d} sessions: direct  {d.describe()}\n"
            f"              gateway {g.describe()} (openai clients), ratio {g.tok_s / d.tok_s:.3f}\n"
            f"              gateway {r.describe()} (plain HTTP clients), ratio {r.tok_s / d.tok_s:.3f}\n"
            f"              worker CPU per token: direct {d.worker_cpu_per_token_ms:.3f} ms, gateway "
            f"{g.worker_cpu_per_token_ms:.3f} ms (openai) / {r.worker_cpu_per_token_ms:.3f} ms (plain), ratios "
            f"{d.worker_cpu_per_token_ms / g.worker_cpu_per_token_ms:.3f} / "
            f"{d.worker_cpu_per_token_ms / r.worker_cpu_per_token_ms:.3f}")


def figures(results: dict[int, tuple[Run, Run, Run]]) -> dict[str, Any]:
    """One placement's figures for the JSON line."""
    top = max(results)
    d, g, r = results[top]
    return {
        "ratios": {str(n): round(g.tok_s / d.tok_s, 3) for n, (d, g, _) in results.items()},
        "plain_http_ratios": {str(n): round(r.tok_s / d.tok_s, 3) for n, (d, _, r) in results.items()},
        "tok_s_direct_openai_plain": {str(n): [round(x.tok_s, 1) for x in runs] for n, runs in results.items()},
        "worker_cpu_ratios": {str(n): [round(d.worker_cpu_per_token_ms / x.worker_cpu_per_token_ms, 3)
                                       for x in (g, r)] for n, (d, g, r) in results.items()},
        "rounds_direct_openai_plain": {str(n): [len(x.rounds) for x in runs] for n, runs in results.items()},
        "round_ms_direct_openai_plain": {str(n): [round(x.round_ms, 2) for x in runs] for n, runs in results.items()},
        "engine_steps_ratio_at_top": [round(len(d.rounds) / len(x.rounds), 3) for x in (g, r)],
        "direct_engine_besides_ms_per_call": round(d.bookkeeping_cpu_s / d.num_calls * 1e3, 3),
        "submit_wall_cpu_ms_per_call_direct_openai_plain": [[round(x.submit_wall_s / x.num_calls * 1e3, 3),
                                                             round(x.submit_cpu_s / x.num_calls * 1e3, 3)]
                                                            for x in results[top]],
        "ms_per_call_at_top": {kind: {"engine_besides_generate": round(x.bookkeeping_cpu_s / x.num_calls * 1e3, 3),
                                      "http_server": round(x.server_cpu_s / x.num_calls * 1e3, 3),
                                      "clients": round(x.client_cpu_s / x.num_calls * 1e3, 3)}
                               for kind, x in (("openai", g), ("plain", r))}}


def main() -> None:
    parser = harness.parser(__doc__, repeats=3)
    parser.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--sessions", default="1,8,64")
    parser.add_argument("--latency-requests", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--cores", default="shared,split", help="where the engine side and the clients run "
                        "(Placement): shared, split, or both (interleaved; the JSON ratio is the first's)")
    parser.add_argument("--openai-http", choices=("aiohttp", "httpx"), default="aiohttp", help="the openai "
                        "clients' transport: aiohttp (openai.DefaultAioHttpClient, as the worker gives each "
                        "episode) or httpx (openai's default, the worker's before 2026-12-04)")
    parser.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval of this process "
                        "(seconds; 0: Python's default, 5 ms)")
    parser.add_argument("--burn", type=float, default=0.0, help="also run direct beside a process that keeps this "
                        "fraction of a core busy in 1 ms slices (a control: CPU taken as the clients and the HTTP "
                        "server take it, without the gateway; shared cores only)")
    parser.add_argument("--profile", action="store_true", help="cProfile the gateway's engine and HTTP server "
                        "threads (CPU clock) over the throughput runs and print where their CPU goes (diagnosis "
                        "only: the profiler's own cost makes the run's figures worse)")
    args = harness.parse(parser, None, backend="hf", tokens=8, calls=2, sessions="2", latency_requests=2,
                         repeats=1, cores="shared")
    configs = [c for c in args.cores.split(",") if c]
    if not configs or set(configs) - {"shared", "split"}:
        parser.error(f"--cores {args.cores!r}: shared, split or shared,split")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    load_start = load()
    from loraflow.common.logging import setup_logging

    setup_logging("bench", level="warning")

    import torch

    torch.set_num_threads(1)
    from bench.report import report
    from loraflow.common.tiny_model import resolve_model
    from loraflow.rollout_worker.backends.base import Sampling
    from loraflow.rollout_worker.backends.hf import HfBackend

    model_dir = resolve_model("builtin:tiny")
    if args.backend == "vllm":
        from loraflow.rollout_worker.backends.vllm import VllmBackend

        backend = VllmBackend(model_dir, sampling=Sampling(), max_loras=1, max_lora_rank=8, max_model_len=512,
                              max_num_seqs=max(64, *(int(x) for x in args.sessions.split(","))), seed=0)
    else:
        backend = HfBackend(model_dir, sampling=Sampling(), device="cpu", seed=0)
    GENERATE_CPU.install(backend)
    placement = Placement(backend.streaming)
    profile = ThreadProfiles() if args.profile else None
    gateway = Gateway(backend, args.chunk, args.tokens, profile, args.openai_http)
    direct(backend, args.chunk, 2, args.tokens, 2)  # warm-up
    print(f"backend {args.backend} ({'streaming' if backend.streaming else f'chunk {args.chunk}'}); "
          f"{args.calls} calls of {args.tokens} tokens per session; load average at the start {load_start}; "
          f"cores: {'; '.join(placement.describe(c) for c in configs)}", flush=True)

    # latency: one request at a time, in the first placement
    gateway.client_cpus = placement.apply(configs[0])
    direct_lat = [direct(backend, args.chunk, 1, args.tokens, 1).wall_s for _ in range(args.latency_requests)]
    gateway_lat = gateway.run(args.latency_requests, args.tokens, 1, serial=True).latencies
    print(f"latency ({configs[0]}), 1 session, {args.tokens} tokens: direct median "
          f"{statistics.median(direct_lat) * 1e3:.1f} ms p99 {pct(direct_lat, 0.99) * 1e3:.1f} ms | gateway median "
          f"{statistics.median(gateway_lat) * 1e3:.1f} ms p99 {pct(gateway_lat, 0.99) * 1e3:.1f} ms | overhead "
          f"median {(statistics.median(gateway_lat) - statistics.median(direct_lat)) * 1e3:.1f} ms")

    results: dict[str, dict[int, tuple[Run, Run, Run]]] = {c: {} for c in configs}
    burned: dict[int, float] = {}  # --burn: direct beside the burner / direct
    shown: set[str] = set()
    for n in [int(x) for x in args.sessions.split(",")]:
        runs: dict[str, list[list[Run]]] = {c: [[], [], []] for c in configs}
        b_runs = []
        for _ in range(args.repeats):  # interleaved: a shared machine's load hits both sides and placements alike
            for config in configs:
                gateway.client_cpus = placement.apply(config)
                if config not in shown:
                    shown.add(config)
                    print(f"[{config} cores] threads' CPUs: {placement.state()}; clients: "
                          f"{','.join(map(str, sorted(gateway.client_cpus or [])))}", flush=True)
                d_runs, g_runs, r_runs = runs[config]
                d_runs.append(direct(backend, args.chunk, n, args.tokens, args.calls))
                g_runs.append(gateway.run(n, args.tokens, args.calls))
                r_runs.append(gateway.run(n, args.tokens, args.calls, "raw"))
                if args.burn and config == "shared":
                    b_runs.append(direct_burned(backend, args.burn, args.chunk, n, args.tokens, args.calls))
        for config in configs:
            d, g, r = (median_run(x) for x in runs[config])
            results[config][n] = (d, g, r)
            print(f"[{config} cores] {describe_count(n, (d, g, r))}")
            if b_runs and config == "shared":
                b = median_run(b_runs)
                burned[n] = b.tok_s / d.tok_s
                print(f"[shared cores] {n:3d} sessions: direct beside a {args.burn:.0%}-of-a-core burner "
                      f"{b.describe()}, ratio {burned[n]:.3f}")
        print(f"load average {load()}", flush=True)
    gateway.close()
    backend.close()
    if profile is not None:
        profile.print(gateway.num_profiled_calls)
    top = max(results[configs[0]])
    ratio = {c: results[c][top][1].tok_s / results[c][top][0].tok_s for c in configs}
    plain = {c: results[c][top][2].tok_s / results[c][top][0].tok_s for c in configs}
    print(f"at {top} sessions, gateway / direct tok/s: " + "; ".join(
        f"{c} cores {ratio[c]:.3f} (openai clients), {plain[c]:.3f} (plain HTTP)" for c in configs))
    d, g, _ = results[configs[0]][top]
    report("gateway", f"tokens_per_s_ratio_at_{top}_sessions", ratio[configs[0]], "ratio", 0.9,
           ratio=ratio[configs[0]], cores=configs[0], gateway_tok_s=round(g.tok_s, 1), direct_tok_s=round(d.tok_s, 1),
           ratio_by_cores={c: round(x, 4) for c, x in ratio.items()},
           plain_http_ratio_by_cores={c: round(x, 4) for c, x in plain.items()},
           backend=args.backend, openai_http=args.openai_http, load_average_start=load_start, load_average_end=load(),
           latency_median_ms=round(statistics.median(gateway_lat) * 1e3, 2),
           latency_p99_ms=round(pct(gateway_lat, 0.99) * 1e3, 2),
           direct_latency_median_ms=round(statistics.median(direct_lat) * 1e3, 2),
           direct_latency_p99_ms=round(pct(direct_lat, 0.99) * 1e3, 2),
           burner_fraction=args.burn, burned_direct_ratios={str(n): round(x, 3) for n, x in burned.items()},
           by_cores={c: figures(results[c]) for c in configs})


if __name__ == "__main__":
    main()
