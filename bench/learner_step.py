"""Learner step time split (wait / compute / publish) and trained tokens/s, 1 rank vs 2 ranks, on this CPU.

A real broker (``python -m loraflow.broker``) is kept full by a producer thread that plays a rollout worker with
synthetic groups (random tokens of the tiny model's vocabulary, log-probs near its uniform policy), so the
learner never starves and the figures describe the learner. The learner runs ``--steps`` steps on the tiny
model twice: as one process and under ``torchrun --nproc_per_node=2``, one torch thread per rank (on a busy
2-core box, two OpenMP threads in one process spin against each other and run several times slower than one).
Per-step figures come from its ``metrics.jsonl``; the first ``--warmup`` steps are dropped.

Last line: value = trained tokens/s with 2 ranks, reference = with 1 rank, same batches, same run.

``--interleaved``: no broker; one process trains the tiny model with the current step (``loraflow.learner.step``) and
with the step before the trained-positions head (:func:`legacy_train_step`: full ``[B, L, V]`` logits, gradient
sync per micro-batch, on :func:`bench.learner_memory.legacy_build`'s model), alternating step by step on the
same synthetic batches, so a busy machine slows both alike. value = median ms of the current step, reference =
of the old one.

    .venv/bin/python -m bench.learner_step [--steps 30] [--groups 16] [--group-size 8] [--ranks 1,2]
        [--set learner.activation_checkpointing=\"on\"] [--set learner.micro_batch_tokens=512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import harness
from bench.report import report
from loraflow.common.cli import one_host_torchrun
from loraflow.common.tiny_model import resolve_model
from tests.learner.scripted import Producer
from tests.support import Processes, child_env, start_broker


def run_learner(tmp: Path, model_dir: Path, ranks: int, args: argparse.Namespace) -> list[dict]:
    """One broker + producer + learner run; returns the learner's per-step metrics."""
    procs, run_dir, producer = Processes(tmp), tmp / f"run-{ranks}", None
    settings = [f"run.groups_per_step={args.groups}", f"run.group_size={args.group_size}", "run.max_staleness=1",
                f"model.path=\"{model_dir}\"", "learner.checkpoint_every=0", "learner.save_adapter_every=0",
                f"learner.lora_rank={args.rank}",
                "integrity.check=false",  # the scripted producer's log-probs come from no model (tests/learner/scripted.py)
                *args.settings]
    try:
        broker = start_broker(procs, *settings, name=f"broker-{ranks}", run_dir=run_dir)
        producer = Producer(broker.endpoint, max_prompt=args.max_prompt, max_completion=args.max_completion)
        producer.start()
        launcher = [] if ranks == 1 else one_host_torchrun(ranks)
        argv = [sys.executable, *launcher, "-m", "loraflow.learner", "--run-dir", str(run_dir), "--endpoint",
                broker.endpoint, "--num-steps", str(args.steps), *(a for s in settings for a in ("--set", s))]
        learner = procs.spawn(f"learner-{ranks}", argv,
                              env=child_env(OMP_NUM_THREADS=str(args.threads) if ranks == 1 else "1"))
        if learner.popen.wait(timeout=1800) != 0:
            raise SystemExit(f"learner with {ranks} rank(s) failed:\n{procs.logs()}")
    finally:
        if producer is not None:
            producer.stop.set()
            producer.join(timeout=10)
        procs.cleanup()
    lines = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    return lines[args.warmup:]


def summarize(lines: list[dict]) -> dict[str, float]:
    out = {f"{k}_ms": 1000 * statistics.median(m[f"{k}_s"] for m in lines) for k in ("wait", "compute", "publish")}
    return {**out, "step_ms": 1000 * statistics.median(m["wait_s"] + m["compute_s"] + m["publish_s"] for m in lines),
            "tokens_per_step": statistics.mean(m["num_tokens"] for m in lines),
            "positions_per_step": statistics.mean(m["num_positions"] for m in lines),
            "tokens_per_s": sum(m["num_tokens"] for m in lines) / sum(m["compute_s"] for m in lines)}


def synthetic_step_batch(args: argparse.Namespace, seed: int) -> Any:
    """A step batch shaped like the producer's groups (random tokens, prompt 2..max, completion 1..max)."""
    import torch

    from loraflow.learner import data

    g = torch.Generator().manual_seed(seed)
    samples, rewards = [], []
    for group in range(args.groups):
        for _ in range(args.group_size):
            prompt = int(torch.randint(2, args.max_prompt + 1, (1,), generator=g))
            completion = int(torch.randint(1, args.max_completion + 1, (1,), generator=g))
            samples.append(data.Sample(group=group, tokens=torch.randint(0, 256, (prompt + completion,), generator=g),
                                       prompt_len=prompt, behaviour_logp=torch.full((completion,), -5.5),
                                       loss_mask=torch.ones(completion, dtype=torch.bool)))
            rewards.append(float(torch.rand(1, generator=g)))
    return data.StepBatch(batch_id=f"synthetic-{seed}", group_ids=[str(i) for i in range(args.groups)],
                          min_versions=[0] * args.groups, samples=samples, rewards=torch.tensor(rewards),
                          group_index=torch.tensor([s.group for s in samples]))


def legacy_train_step(model: Any, optimizer: Any, step: Any, *, config: Any, loss_config: Any) -> float:
    """The step before logits-only-where-trained: [B, L, V] logits, fp32 log-softmax copies, sync per micro-batch."""
    import torch

    from loraflow.common import logprobs
    from loraflow.learner import data
    from loraflow.learner.loss import group_advantages, token_loss

    advantages, _ = group_advantages(step.rewards, step.group_index, step.num_groups, scale_by_std=True)
    micro_batches = data.rank_micro_batches(step, advantages, rank=0, world_size=1,
                                            budget_tokens=config.learner.micro_batch_tokens)
    scale = 1 / max(step.num_trained_tokens, 1)
    for mb in micro_batches:
        targets = mb.targets[mb.select]
        logits = model(input_ids=mb.input_ids, use_cache=False).logits[mb.select]
        logp = logprobs.token_logprobs(logits, targets, 1.0)
        terms = token_loss(logp, mb.behaviour_logp, mb.advantages, loss_config, None)
        (terms.loss.sum() * scale).backward()
        with torch.no_grad():
            logprobs.token_entropy(logits.detach(), 1.0)
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], config.learner.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return 0.0


def interleaved(args: argparse.Namespace) -> None:
    """Old and new step code in one process, alternating step by step (both see the same machine load)."""
    import time

    import torch

    from bench.learner_memory import legacy_build
    from loraflow.common.config import load_config
    from loraflow.learner.loss import LossConfig
    from loraflow.learner.model import build_policy
    from loraflow.learner.parallel import init_parallel
    from loraflow.learner.step import make_optimizer, train_step

    torch.set_num_threads(args.threads)
    parallel = init_parallel("cpu")
    config = load_config(None, [f"learner.lora_rank={args.rank}", *args.settings])
    loss_config = LossConfig.from_learner(config.learner)
    model_dir = resolve_model("builtin:tiny")
    policy = build_policy(model_dir, config.learner, parallel, seed=0)
    optimizer, scheduler = make_optimizer(policy, config.learner)
    old_model = legacy_build(model_dir, config.learner, parallel, seed=0)
    old_optimizer = torch.optim.AdamW([p for p in old_model.parameters() if p.requires_grad], lr=config.learner.lr)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for index in range(args.steps):
        batch = synthetic_step_batch(args, index)
        for name in (("before", "after") if index % 2 else ("after", "before")):
            started = time.perf_counter()
            if name == "after":
                train_step(policy, optimizer, scheduler, batch, parallel=parallel, config=config,
                           loss_config=loss_config)
            else:
                legacy_train_step(old_model, old_optimizer, batch, config=config, loss_config=loss_config)
            if index >= args.warmup:
                times[name].append(time.perf_counter() - started)
    before, after = (1000 * statistics.median(times[k]) for k in ("before", "after"))
    tokens = statistics.mean(synthetic_step_batch(args, i).num_trained_tokens for i in range(args.steps))
    print(f"tiny model, one process, {args.threads} thread(s), old and new step alternating, "
          f"{len(times['after'])} steps each (medians), ~{tokens:.0f} trained tokens per step")
    print(f"  before (full logits, sync per micro-batch): {before:8.1f} ms")
    print(f"  after  (trained positions, chunked head):   {after:8.1f} ms")
    report("learner_step", "step_ms_interleaved", after, "ms", before, settings=args.settings)
    parallel.close()


def main() -> None:
    parser = harness.flags(harness.parser(__doc__), {
        "steps": 30, "warmup": 3, "groups": (16, "groups per step"), "group_size": 8, "max_prompt": 12,
        "max_completion": 48, "rank": (16, "LoRA rank"), "ranks": ("1,2", "which runs (comma-separated rank counts)"),
        "threads": (1, "torch threads of the 1-rank run (ranks get 1)")})
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help='extra settings of both runs, e.g. learner.activation_checkpointing="on"')
    parser.add_argument("--interleaved", action="store_true",
                        help="old vs new step code in one process, alternating (no broker)")
    args = harness.parse(parser, None, steps=3, warmup=1, groups=2, group_size=4, max_completion=8)
    if args.interleaved:
        interleaved(args)
        return
    model_dir = resolve_model("builtin:tiny")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            results[ranks] = summarize(run_learner(Path(tmp), model_dir, ranks, args))
    print(f"tiny model, LoRA r={args.rank}, {args.groups} groups x {args.group_size} samples per step, "
          f"{args.steps - args.warmup} steps measured (medians)")
    print(f"{'ranks':>5} {'wait ms':>9} {'compute ms':>11} {'publish ms':>11} {'step ms':>9} "
          f"{'tokens/step':>12} {'tokens/s':>9}")
    for ranks, r in results.items():
        print(f"{ranks:>5} {r['wait_ms']:>9.1f} {r['compute_ms']:>11.1f} {r['publish_ms']:>11.1f} "
              f"{r['step_ms']:>9.1f} {r['tokens_per_step']:>12.0f} {r['tokens_per_s']:>9.0f}")
    one, two = results.get(1, results[max(results)]), results[max(results)]
    report("learner_step", "trained_tokens_per_s_2_ranks", two["tokens_per_s"], "tokens/s",
           one["tokens_per_s"], **{f"r1_{k}": round(v, 3) for k, v in one.items()},
           **{f"r2_{k}": round(v, 3) for k, v in two.items()})


if __name__ == "__main__":
    main()
