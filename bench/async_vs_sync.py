"""Asynchrony measured: the same number of samples at max_staleness 0 (synchronous), 1, 2 and 4, in one run.

    .venv/bin/python -m bench.async_vs_sync [--workers 8] [--steps 24] [--train-s auto]

Per mode: a real broker, ``--workers`` rollout workers on the sim backend (lognormal completion lengths at a fixed
tokens/s per stream: the figures describe the orchestration), and a learner speaking the real protocol
(``BrokerSession``: long-polled batches, AdapterUpdate v+1 after each step, BatchAck) whose step is a sleep of
``train_s``. The first ``--warmup`` steps are not timed. First generation alone (a learner that trains in no time,
the loosest staleness) gives ``gen_s`` per step; ``train_s`` is set to it (equal stages: the largest gain from
overlap), then each max_staleness runs. Ideal overlap: a step of max(gen_s, train_s) instead of the sum. The JSON
line's value is samples/s at ``--report-staleness``, its reference the ideal samples/s, ``ratio`` the share of the
ideal reached.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import harness
from loraflow.common.config import load_config
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import BatchAck
from loraflow.common.transport import fetch_stats
from loraflow.learner.publish import AdapterSnapshot, tensors_sha256
from loraflow.learner.session import BrokerSession
from tests.support import Processes, start_broker, wait_for

# a small LoRA-shaped adapter: workers verify and store every version as usual
ADAPTER_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                  "task_type": "CAUSAL_LM", "inference_mode": True}


@dataclass(slots=True, kw_only=True)
class ModeResult:
    max_staleness: int
    samples_per_s: float
    step_s: float
    wait_s: float  # mean wait for a batch per timed step
    busy_share: float
    staleness: dict[int, int]
    num_dropped_stale: int = 0  # groups the broker dropped as too stale (their prompts generated again)


def adapter(version: int) -> AdapterSnapshot:
    tensors = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.full((4, 128), float(version))),
               ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(128, 4))]
    return AdapterSnapshot(version=version, step=version, tensors=tensors, adapter_config=ADAPTER_CONFIG,
                           sha256=tensors_sha256(tensors), base_model="sim")


def settings(args: argparse.Namespace, max_staleness: int) -> list[str]:
    return [f"run.max_staleness={max_staleness}", f"run.groups_per_step={args.groups}",
            f"run.group_size={args.group_size}", "broker.heartbeat_interval_s=0.5", "worker.backend=\"sim\"",
            f"worker.capacity={args.capacity}", f"worker.chunk_tokens={args.chunk_tokens}",
            f"worker.max_new_tokens={args.max_tokens}", f"worker.sim.tokens_per_s={args.tokens_per_s}",
            f"worker.sim.mean_tokens={args.mean_tokens}", f"worker.sim.length_sigma={args.sigma}",
            f"worker.sim.max_tokens={args.max_tokens}", f"run.seed={args.seed}"]


def run_mode(tmp: Path, args: argparse.Namespace, max_staleness: int) -> ModeResult:
    tmp.mkdir(parents=True, exist_ok=True)
    procs, run_dir, overrides, session = Processes(tmp), tmp / "run", settings(args, max_staleness), None
    try:
        broker = start_broker(procs, *overrides, run_dir=run_dir)
        worker_args = ["--run-dir", str(run_dir), "--endpoint", broker.endpoint,
                       *(arg for item in overrides for arg in ("--set", item))]
        for i in range(args.workers):
            procs.python(f"worker-{i}", "loraflow.rollout_worker", *worker_args, "--worker-id", f"sim-{i}")
        wait_for(lambda: len(fetch_stats(broker.endpoint)["workers"]) == args.workers, 120,
                 f"{args.workers} workers to join", procs)
        config = load_config(None, [*overrides, f"broker.endpoint=\"{broker.endpoint}\"", f'run.run_dir="{run_dir}"'])
        session = BrokerSession(config, version=0, metrics=Metrics(), client_id="bench-learner")
        session.start(30)
        result = learn(session, args, max_staleness)
        dropped = fetch_stats(broker.endpoint)["dropped"]
        result.num_dropped_stale = int(dropped.get("stale", 0) + dropped.get("stale_on_arrival", 0))
        return result
    finally:
        if session is not None:
            session.close("done")
        procs.cleanup()


def learn(session: BrokerSession, args: argparse.Namespace, max_staleness: int) -> ModeResult:
    """The learner with a controlled step cost: batch in, sleep ``train_s``, publish v+1, ack."""
    version, staleness, waits, started = 0, {}, [], 0.0
    session.want_batch(args.groups, 1000, version)
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            started = time.monotonic()
        waited = time.monotonic()
        while (item := session.poll(0.5)) is None:
            pass
        if step > args.warmup:
            waits.append(time.monotonic() - waited)
            for entry in item.record.groups:
                lag = version - entry.group.min_version
                staleness[lag] = staleness.get(lag, 0) + 1
        time.sleep(args.train_s_value)
        version += 1
        session.publish(adapter(version))
        session.want_batch(args.groups, 1000, version)
        session.ack_batch(BatchAck(batch_id=item.record.batch_id, step=step, trained_version=version - 1,
                                   group_ids=[e.group.group_id for e in item.record.groups]))
    wall_s = time.monotonic() - started
    timed = args.steps - args.warmup
    assert max(staleness) <= max_staleness, f"trained staleness {staleness} beyond {max_staleness}"
    return ModeResult(max_staleness=max_staleness, samples_per_s=timed * args.groups * args.group_size / wall_s,
                      step_s=wall_s / timed, wait_s=statistics.mean(waits), busy_share=timed * args.train_s_value / wall_s,
                      staleness=dict(sorted(staleness.items())))


FLAGS = {"workers": 8, "capacity": (2, "groups each worker generates at once"), "steps": 24, "warmup": 4,
         "groups": (16, "groups per step"), "group_size": 8,
         "train_s": ("auto", "the learner's step cost in s; auto = generation time"),
         "tokens_per_s": (1000.0, "sim decode speed per stream"), "mean_tokens": 48.0,
         "sigma": (1.0, "lognormal sigma of completion lengths"), "max_tokens": 512, "chunk_tokens": 16,
         "staleness": [0, 1, 2, 4], "report_staleness": 4, "seed": 0}


def main() -> None:
    args = harness.parse(harness.flags(harness.parser(__doc__), FLAGS), None, workers=2, steps=3, warmup=1, groups=4,
                         group_size=4, mean_tokens=8.0, max_tokens=32, staleness=[0, 2], report_staleness=2)
    if args.staleness[0] != 0:
        raise SystemExit("--staleness must start with 0: the synchronous run is the reference")
    samples_per_step = args.groups * args.group_size
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        args.train_s_value = 0.0
        gen_s = samples_per_step / run_mode(Path(tmp) / "gen", args, max(args.staleness)).samples_per_s
        train_s = args.train_s_value = gen_s if args.train_s == "auto" else float(args.train_s)
        print(f"generation alone: {gen_s * 1000:.0f} ms per step of {samples_per_step} samples; learner step cost "
              f"{train_s * 1000:.0f} ms", flush=True)
        results = [run_mode(Path(tmp) / str(m), args, m) for m in args.staleness]
    sync, ideal_step_s = results[0], max(gen_s, train_s)
    bound, ideal_rate = (gen_s + train_s) / ideal_step_s, samples_per_step / ideal_step_s
    print(f"ideal overlap: a step of {ideal_step_s * 1000:.0f} ms instead of {(gen_s + train_s) * 1000:.0f} ms, "
          f"{bound:.2f}x over sync ({ideal_rate:.1f} samples/s)")
    harness.table(("max_staleness", "samples/s", "vs sync", "of ideal overlap", "learner busy", "step", "wait",
                   "groups dropped as stale", "staleness trained"),
                  [(r.max_staleness, f"{r.samples_per_s:.1f}", f"{r.samples_per_s / sync.samples_per_s:.2f}x",
                    f"{r.samples_per_s / ideal_rate:.1%}", f"{r.busy_share:.1%}", f"{r.step_s * 1000:.0f} ms",
                    f"{r.wait_s * 1000:.0f} ms", r.num_dropped_stale, r.staleness) for r in results])
    chosen = next(r for r in results if r.max_staleness == args.report_staleness)
    harness.report("async_vs_sync", f"samples_per_s_staleness_{args.report_staleness}", chosen.samples_per_s,
                   "samples/s", ideal_rate, ratio=chosen.samples_per_s / ideal_rate,
                   ratio_is="share of the ideal overlap reached", ideal_bound_x=round(bound, 3),
                   speedup_vs_sync=round(chosen.samples_per_s / sync.samples_per_s, 3),
                   sync_samples_per_s=round(sync.samples_per_s, 2), learner_busy_share=round(chosen.busy_share, 4),
                   sync_busy_share=round(sync.busy_share, 4), gen_s=round(gen_s, 4), train_s=round(train_s, 4),
                   by_staleness={str(r.max_staleness): round(r.samples_per_s, 2) for r in results})


if __name__ == "__main__":
    main()
