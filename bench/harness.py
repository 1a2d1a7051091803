"""What every bench shares besides its measurement: the common arguments (``--quick``, ``--repeats``,
``--seconds``), interleaved repeats with medians, the printed table and the final JSON line (bench/report.py),
and the processes (the broker, bench/broker_proc.py; clients as ``multiprocessing`` children).

A bench builds its parser with :func:`parser`, reads it with :func:`parse` giving the ``--quick`` values
(small sizes, seconds not minutes, the same code path and the same final line; an explicit flag still wins),
and times its variants side by side with :func:`interleave`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.broker_proc import REPO, RUN_TOKEN, start_broker  # noqa: F401 - re-exported for the benches
from bench.report import checkout_env, report, scratch_dir  # noqa: F401 - re-exported for the benches
from loraflow.common import framing

#: the wire encode/decode, moving from common/protocol.py to common/codec.py (#36): whichever this tree has
codec = importlib.import_module("loraflow.common.codec" if importlib.util.find_spec("loraflow.common.codec")
                                else "loraflow.common.protocol")

#: the benches ``make bench`` and tests/bench/test_quick.py run (the rest of bench/ are their libraries:
#: report, broker_proc, harness, netns, netbed, netproxy, accuracy_runs, single_process, gpu_smoke)
BENCHES = (
    "adapter_fanout", "adapter_load", "adapter_swap", "adapter_write", "agent_demo", "async_vs_sync",
    "broker_core_cpu", "broker_memory", "broker_scale", "broker_throughput", "broker_waiters", "gateway",
    "gateway_conformance", "generation", "integrity", "integrity_bf16", "join_time", "learner_memory",
    "learner_step", "multi_tenant", "net_faults", "prompt_render", "soak", "staleness_lengths", "time_to_accuracy", "vs_trl",
    "weight_sync",
)


def parser(doc: str | None, *, repeats: int | None = None, seconds: float | None = None,
           **kwargs: Any) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` described by the first paragraph of ``doc`` with ``--quick`` and, where the bench
    has them, ``--repeats`` (interleaved runs, median kept) and ``--seconds`` (measured seconds per run)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0], **kwargs)
    p.add_argument("--quick", action="store_true", help="small sizes, seconds not minutes: the code path, "
                   "not a figure (tests/bench/test_quick.py)")
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help="interleaved runs (median kept)")
    if seconds is not None:
        p.add_argument("--seconds", type=float, default=seconds, help="measured seconds per run")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None, **quick: Any) -> argparse.Namespace:
    """``p.parse_args(argv)``; with ``--quick`` the ``quick`` values replace the defaults first."""
    args = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in args and quick:
        p.set_defaults(**quick)
    return p.parse_args(args)


def interleave(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Each variant run ``repeats`` times, round by round (a drifting machine hits all of them alike)."""
    runs: dict[str, list[Any]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            runs[name].append(run())
    return runs


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``, nearest rank below (``pct(v, 0.99)``: p99)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages, as printed beside a figure."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Print a Markdown table (the form BENCHMARKS.md keeps)."""
    print("| " + " | ".join(map(str, header)) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


def spawn(target: Callable[..., Any], *args: Any, daemon: bool = True) -> mp.Process:
    """A started ``spawn`` child running ``target(*args)`` (clients beside the broker)."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=daemon)
    proc.start()
    return proc


def sizes(text: str) -> list[int]:
    """``"16384,262144"`` -> ``[16384, 262144]`` (empty entries dropped)."""
    return [int(part) for part in text.split(",") if part.strip()]


def in_tree(argv: Sequence[str], tree: Path = REPO, *, timeout_s: float | None = 600, cwd: Path = REPO,
            **env: str) -> Any:
    """The JSON of the last stdout line of ``python *argv`` run with ``tree``'s code (bench/report.py
    checkout_env; ``env`` added): one measurement of another checkout in the same run."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, *argv], env={**checkout_env(tree), **env}, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, *, proc: Any = None,
               interval_s: float = 0.2) -> Any:
    """``condition()``'s first truthy value, polled every ``interval_s``; SystemExit naming ``what`` after
    ``timeout_s`` or once ``proc`` (a Popen) has exited."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            raise SystemExit(f"timed out after {timeout_s:g} s waiting for {what}" if proc is None or
                             proc.poll() is None else f"exited ({proc.poll()}) while waiting for {what}")
        time.sleep(interval_s)
    return value


def tiny_backend(name: str, model_dir: Any = None, **kwargs: Any) -> Any:
    """A generation backend (``vllm...`` or ``hf...``) on ``model_dir`` (default: the built-in tiny model),
    default sampling; ``kwargs`` go to the backend's constructor (hf: on the CPU unless ``device`` says)."""
    from loraflow.rollout_worker.backends.base import Sampling

    if model_dir is None:
        from loraflow.common.tiny_model import resolve_model

        model_dir = resolve_model("builtin:tiny")
    kwargs.setdefault("sampling", Sampling())
    if name.startswith("vllm"):
        from loraflow.rollout_worker.backends.vllm import VllmBackend

        return VllmBackend(model_dir, **kwargs)
    from loraflow.rollout_worker.backends.hf import HfBackend

    return HfBackend(model_dir, **{"device": "cpu", **kwargs})


# -- raw broker clients (pyzmq DEALERs speaking the wire format, lighter than the real clients) --

def kind(frames: Sequence[Any]) -> int:
    """The message kind of a received multipart message (``copy=False`` frames), its header left undecoded."""
    return framing.PREAMBLE.unpack(frames[0].buffer)[2]


def kind_and_header(frames: Sequence[Any]) -> tuple[int, dict]:
    """(message kind, msgpack header) of a received multipart message (``copy=False`` frames)."""
    import msgpack

    return kind(frames), msgpack.unpackb(frames[1].buffer)


def hello(sock: Any, role: str, name: str, **fields: Any) -> None:
    """Send a Hello (a learner's carries the bench run token) and wait for the broker's Welcome."""
    import uuid

    from loraflow.common.protocol import Hello, Kind

    fields.setdefault("session", uuid.uuid4().hex[:8])
    sock.send_multipart(codec.encode(Hello(role=role, client_id=name, token=RUN_TOKEN if role == "learner" else "",
                                           **fields)))
    while kind_and_header(sock.recv_multipart(copy=False))[0] != Kind.WELCOME:
        pass


def dealer(ctx: Any, endpoint: str, role: str, name: str, **fields: Any) -> Any:
    """A DEALER with identity ``role/name``, connected and welcomed (:func:`hello`)."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{role}/{name}".encode())
    sock.connect(endpoint)
    hello(sock, role, name, **fields)
    return sock


def reap(children: Iterable[Any], broker: Any = None, timeout_s: float = 10.0) -> None:
    """Join each child process (killed if it is still alive after ``timeout_s``), then stop the broker."""
    for child in children:
        child.join(timeout=timeout_s)
        if child.is_alive():
            child.kill()
    if broker is not None:
        broker.terminate()
        broker.wait(timeout=30)


# -- what a process costs (Linux /proc) --

def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of a process (or one of its threads) so far (Linux /proc)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads: "main", zmq's "io" threads, "other" (e.g. the state writer;
    a thread that ended since the last call is missing from both, so compare only over a run)."""
    out = {"main": 0.0, "io": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        tid = int(task.name)
        name = "main" if tid == pid else "io" if (task / "comm").read_text().startswith("ZMQbg/IO") else "other"
        out[name] += cpu_seconds(pid, tid)
    return out


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores so far (/proc/stat): the share of the machine in use."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


# -- rollout groups and adapters as the clients send them (broker benches) --

GROUP_SIZE, PROMPT_LEN = 8, 16  # samples per group, prompt tokens per sample


def group_tensors(num_bytes: int) -> list[tuple[str, Any]]:
    """The five tensors of a GROUP_SIZE-sample rollout group of about ``num_bytes``."""
    import numpy as np

    n = GROUP_SIZE * max(1, (num_bytes - GROUP_SIZE * PROMPT_LEN * 4) // (13 * GROUP_SIZE))
    rng = np.random.default_rng(0)
    return [("prompt_ids", rng.integers(0, 200, GROUP_SIZE * PROMPT_LEN, dtype=np.int32)),
            ("completion_ids", rng.integers(0, 200, n, dtype=np.int32)),
            ("logprobs", np.full(n, -0.7, dtype=np.float32)), ("versions", np.zeros(n, dtype=np.int32)),
            ("loss_mask", np.ones(n, dtype=np.uint8))]


def group_record(group_id: str, lease_id: str, worker: str, tensors: list) -> Any:
    """The RolloutGroup record that goes with :func:`group_tensors` (version 0, reward 0)."""
    from loraflow.common.protocol import RolloutGroup

    completion_len = len(tensors[1][1]) // GROUP_SIZE
    return RolloutGroup(group_id=group_id, lease_id=lease_id, worker_id=worker, task="arith",
                        prompt_lens=[PROMPT_LEN] * GROUP_SIZE, completion_lens=[completion_len] * GROUP_SIZE,
                        rewards=[0.0] * GROUP_SIZE, finish_reasons=["stop"] * GROUP_SIZE, min_version=0,
                        max_version=0)


def adapter_tensors(num_bytes: int) -> list[tuple[str, Any]]:
    """LoRA A/B pairs of 4 attention projections x 8 layers (float32, PEFT names), about ``num_bytes`` in all."""
    import numpy as np

    names = [f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.weight"
             for layer in range(8) for proj in ("q_proj", "k_proj", "v_proj", "o_proj") for ab in ("A", "B")]
    rng = np.random.default_rng(0)
    return [(name, rng.standard_normal(max(1, num_bytes // (4 * len(names))), dtype=np.float32)) for name in names]


def flags(p: argparse.ArgumentParser, defaults: dict[str, Any]) -> argparse.ArgumentParser:
    """``--name-with-dashes`` for each key of ``defaults``, typed by its default value (a list: ``nargs="+"``); a
    value ``(default, "what it is")`` gives the flag its ``--help`` text."""
    for name, value in defaults.items():
        default, text = value if isinstance(value, tuple) else (value, None)
        if isinstance(default, list):
            p.add_argument("--" + name.replace("_", "-"), type=type(default[0]), nargs="+", default=default, help=text)
        else:
            p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=text)
    return p
