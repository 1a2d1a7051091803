"""Elastic join under load: process start -> first accepted group of workers joining a fast-publishing run.

    .venv/bin/python -m bench.join_time [--workers 3] [--rate 0] [--warmup-versions 50] [--timeout 180]

A broker and a stand-in learner (``--role learner``) that publishes a new LoRA adapter of the tiny model as soon
as the broker acked the previous one (``--rate`` caps versions/s) and acks every batch at once. After
``--warmup-versions`` versions, ``--workers`` hf workers start together, and beside them a reference process
(``--role reference``) that only loads the model and one adapter and generates one group, with no broker. The
figure: the workers' median spawn -> the broker's Ack of their first accepted group (from their JSON logs); the
reference: the reference's spawn -> done, under the same load.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import REPO, RUN_TOKEN, report, scratch_dir, start_broker

#: worker settings shared by the joiners and the reference: small groups, one chunk per sample
WORKER_SETTINGS = {"worker.max_new_tokens": "8", "worker.chunk_tokens": "8", "worker.num_threads": "1"}
GROUP_SIZE = 2
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_layout(model_dir: Path, rank: int = 8) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, Any]]:
    """PEFT tensor names and shapes of a rank-``rank`` LoRA on every projection of the model, and its config."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS)))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "adapter_config.json").read_text())
    return [(name, tuple(t.shape)) for name, t in get_peft_model_state_dict(model).items()], config


def adapter_message(version: int, layout: list[tuple[str, tuple[int, ...]]], config: dict[str, Any]) -> tuple:
    """An AdapterUpdate of ``version`` with small random weights (a different adapter every version)."""
    import numpy as np

    from bench.harness import codec
    from loraflow.common.framing import frames_sha256
    from loraflow.common.protocol import AdapterUpdate

    rng = np.random.default_rng(version)
    tensors = [(name, (rng.standard_normal(shape) * 0.01).astype(np.float32)) for name, shape in layout]
    sha = frames_sha256(codec.encode(AdapterUpdate(version=version, sha256="", adapter_config={}), tensors)[2:])
    return AdapterUpdate(version=version, sha256=sha, adapter_config=config, step=version), tensors


def run_learner(endpoint: str, model_dir: Path, rate: float, batch_groups: int) -> None:
    """Publish versions as fast as the broker acknowledges them (at most ``rate``/s), take and ack batches."""
    from loraflow.common.protocol import Ack, Batch, BatchAck, BatchRequest, Error, Hello, Kind
    from loraflow.common.transport import BrokerLink, Incoming

    layout, config = lora_layout(model_dir)
    link = BrokerLink(endpoint, Hello(role="learner", client_id="fast-learner", token=RUN_TOKEN),
                      heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0)
    version = link.start(timeout_s=30).latest_version
    asked, published_at = False, 0.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        if not asked:
            link.send(BatchRequest(num_groups=batch_groups, wait_ms=0, learner_version=version))
            asked = True
        if rate:
            time.sleep(max(0.0, published_at + 1 / rate - time.monotonic()))
        published_at = time.monotonic()
        link.send(*adapter_message(version + 1, layout, config))
        while True:  # until the broker answers the publication; batches are acked on the way
            item = link.recv(timeout_s=30)
            if not isinstance(item, Incoming):
                continue
            record = item.record
            if isinstance(record, Batch):
                asked = False
                if record.groups:
                    link.send(BatchAck(batch_id=record.batch_id, step=version, trained_version=version,
                                       group_ids=[e.group.group_id for e in record.groups]))
            elif isinstance(record, Ack | Error) and record.ref_kind == Kind.ADAPTER_UPDATE:
                if isinstance(record, Error):
                    raise SystemExit(f"publish of v{version + 1} refused: {record.message}")
                version += 1
                if version % 100 == 0:
                    print(json.dumps({"event": "published", "version": version, "unix": time.time()}), flush=True)
                break


def run_reference(model_dir: Path, adapter_dir: Path) -> None:
    """Load the model, one adapter (written as a worker's store writes it), generate one group; print timings."""
    started = time.monotonic()
    from loraflow.common.config import load_config
    from loraflow.common.protocol import PromptLease
    from loraflow.common.tasks import ArithTask
    from loraflow.rollout_worker.adapters import AdapterStore
    from loraflow.rollout_worker.backends import make_backend
    from loraflow.rollout_worker.envs import EnvResolver
    from loraflow.rollout_worker.rollout import Rollouts

    config = load_config(overrides=[f'model.path="{model_dir}"', 'worker.backend="hf"',
                                    *(f"{k}={v}" for k, v in WORKER_SETTINGS.items())])
    data = json.loads((adapter_dir / "layout.json").read_text())
    layout, peft_config = [(name, tuple(shape)) for name, shape in data["layout"]], data["config"]
    store = AdapterStore(scratch_dir(prefix="join-ref-"))
    import_s = time.monotonic() - started
    loading = time.monotonic()
    backend = make_backend(config, worker_id="reference", max_staleness=0)
    model_s = time.monotonic() - loading
    update, tensors = adapter_message(1, layout, peft_config)
    from bench.harness import codec

    _, envelope = codec.decode([bytes(f) for f in codec.encode(update, tensors)])
    loading = time.monotonic()
    backend.add_adapter(store.receive(update, envelope.specs, envelope.frames))
    adapter_s = time.monotonic() - loading
    rollouts = Rollouts(backend, EnvResolver(config.worker.env), config.worker, worker_id="reference",
                        max_seq_len=config.model.max_seq_len)
    item = ArithTask(seed=0).item(0)
    rollouts.add(PromptLease(lease_id="l0", group_id="0:0", prompt_index=0, epoch=0, task="arith",
                             prompt=item.prompt, answer=item.answer, group_size=GROUP_SIZE, deadline_s=600))
    generating = time.monotonic()
    while rollouts.num_groups:
        rollouts.step() or time.sleep(0.001)
    print(json.dumps({"import_s": import_s, "model_load_s": model_s, "adapter_load_s": adapter_s,
                      "generate_s": time.monotonic() - generating, "done_unix": time.time()}), flush=True)


def log_events(path: Path) -> list[dict[str, Any]]:
    """The JSON log lines with an event of a process's log (other lines skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            item = json.loads(line)
            if isinstance(item, dict) and "event" in item:
                out.append(item)
    return out


def unix(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def join_pieces(events: list[dict[str, Any]], spawned_unix: float) -> dict[str, float] | None:
    """A joiner's timings from its JSON log, once it has an accepted group; None before."""
    accepted = next((e for e in events if e["event"] == "group_acked" and e.get("status") == "accepted"), None)
    if accepted is None:
        return None
    ready = next(e for e in events if e["event"] == "backend_ready")
    first_load = next(e for e in events if e["event"] == "adapter_loaded")
    first_group = next(e for e in events if e["event"] == "group_submitted")
    loads_before = [e for e in events if e["event"] == "adapter_loaded" and unix(e) <= unix(first_group)]
    joined = next(e for e in events if e["event"] == "joined")
    return {"join_s": unix(accepted) - spawned_unix, "start_s": unix(joined) - spawned_unix,
            "model_load_s": ready["load_s"], "adapter_load_s": first_load["load_ms"] / 1000,
            "generate_s": first_group.get("generate_s", float("nan")), "loads_before_first_group": len(loads_before),
            "first_version": first_load["version"]}


def worker_argv(endpoint: str, run_dir: Path, worker_id: str, model_dir: Path) -> list[str]:
    return [sys.executable, "-m", "loraflow.rollout_worker", "--endpoint", endpoint, "--run-dir", str(run_dir),
            "--worker-id", worker_id, "--backend", "hf", "--log-format", "json", "--set", f'model.path="{model_dir}"',
            *(a for key, value in WORKER_SETTINGS.items() for a in ("--set", f"{key}={value}"))]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)


def main() -> None:
    parser = harness.flags(harness.parser(__doc__), {
        "endpoint": "", "model_dir": "", "adapter_dir": "", "workers": 3, "warmup_versions": 50, "timeout": 180.0,
        "rate": (0.0, "versions/s at most; 0 = as fast as it can")})
    parser.add_argument("--role", choices=("bench", "learner", "reference"), default="bench")
    args = harness.parse(parser, None, workers=1, warmup_versions=5, timeout=120.0)
    if args.role == "learner":
        return run_learner(args.endpoint, Path(args.model_dir), args.rate, batch_groups=4)
    if args.role == "reference":
        return run_reference(Path(args.model_dir), Path(args.adapter_dir))

    from loraflow.common.tiny_model import resolve_model
    from loraflow.common.transport import fetch_stats

    model_dir = resolve_model("builtin:tiny")
    work = Path(scratch_dir(prefix="bench-join-"))
    layout, config = lora_layout(model_dir)
    (work / "layout.json").write_text(json.dumps({"layout": layout, "config": config}))
    broker, endpoint = start_broker(work, f'model.path="{model_dir}"', "run.max_staleness=1000",
                                    f"run.group_size={GROUP_SIZE}", "run.groups_per_step=4",
                                    "broker.heartbeat_interval_s=0.5", "broker.heartbeat_misses=20")
    procs: list[subprocess.Popen] = [broker]
    try:
        procs.append(spawn([sys.executable, __file__, "--role", "learner", "--endpoint", endpoint, "--model-dir",
                            str(model_dir), "--rate", str(args.rate)], work / "learner.log"))
        try:
            harness.wait_until(lambda: fetch_stats(endpoint, timeout_s=5)["latest_version"] >= args.warmup_versions,
                               120, f"{args.warmup_versions} versions published", proc=procs[-1])
        except SystemExit as e:
            raise SystemExit(f"{e}: {(work / 'learner.log').read_text()[-2000:]}") from None
        version_at_join, joined_at = fetch_stats(endpoint)["latest_version"], time.monotonic()
        spawned = {}
        for name in (f"joiner{i}" for i in range(args.workers)):
            spawned[name] = time.time()
            procs.append(spawn(worker_argv(endpoint, work / "run", name, model_dir), work / f"{name}.log"))
        reference_spawned = time.time()
        reference = subprocess.run([sys.executable, __file__, "--role", "reference", "--model-dir", str(model_dir),
                                    "--adapter-dir", str(work)], capture_output=True, text=True, env=child_env(),
                                   cwd=REPO, timeout=args.timeout)
        if reference.returncode:
            raise SystemExit(f"the reference failed:\n{reference.stderr[-3000:]}")
        ref = json.loads(reference.stdout.strip().splitlines()[-1])
        reference_s = ref["done_unix"] - reference_spawned
        pieces: dict[str, dict[str, float]] = {}
        max_dirs, deadline = 0, time.monotonic() + args.timeout
        while len(pieces) < args.workers and time.monotonic() < deadline:
            for name in spawned:
                adapters = work / "run" / "workers" / name / "adapters"
                if adapters.is_dir():
                    max_dirs = max(max_dirs, sum(1 for p in adapters.iterdir() if p.name.startswith("v")))
                if name not in pieces and (found := join_pieces(log_events(work / f"{name}.log"), spawned[name])):
                    pieces[name] = found
            time.sleep(0.2)
        stats = fetch_stats(endpoint)
        rate = (stats["latest_version"] - version_at_join) / (time.monotonic() - joined_at)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
            proc.kill()
    print(f"learner published {rate:.0f} versions/s while the workers joined (from v{version_at_join}); "
          f"max_staleness 1000, group_size {GROUP_SIZE}, {WORKER_SETTINGS['worker.max_new_tokens']} tokens")
    print(f"reference (start + model {ref['model_load_s']:.2f} s + adapter {ref['adapter_load_s'] * 1000:.0f} ms + "
          f"one group {ref['generate_s']:.2f} s, no broker): {reference_s:.2f} s")
    for name, p in sorted(pieces.items()):
        print(f"{name}: join {p['join_s']:.2f} s  (start+connect {p['start_s']:.2f} s, model {p['model_load_s']:.2f} s,"
              f" first adapter v{p['first_version']:.0f} {p['adapter_load_s'] * 1000:.0f} ms, first group "
              f"{p['generate_s']:.2f} s, {p['loads_before_first_group']:.0f} adapters loaded before it)")
    missing = sorted(set(spawned) - set(pieces))
    if missing:
        print(f"no accepted group within {args.timeout:.0f} s from: {', '.join(missing)}")
    joins = [p["join_s"] for p in pieces.values()] + [float("inf")] * len(missing)
    median = statistics.median(joins)
    print(f"median join {median:.2f} s vs reference {reference_s:.2f} s; adapter dirs of a joiner at most {max_dirs}")
    report("join_time", "median_join_s", median, "s", reference_s, workers=args.workers,
           versions_per_s=round(rate, 1), max_adapter_dirs=max_dirs,
           max_join_s=round(max(joins), 3), joined=len(pieces))


if __name__ == "__main__":
    main()
