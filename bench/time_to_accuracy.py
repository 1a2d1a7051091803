"""Training wall time and samples to the demo's accuracy target: loraflow against a single process, same run.

The real thing: ``loraflow run`` on the demo config (tiny model warmed up by deploy/demo_base.py, 2 hf workers,
the learner, the broker), and right after it, on the same resolved config, the same GRPO loop in one process
built from the same code (:mod:`bench.single_process`: the worker's Rollouts and hf backend, the learner's
Policy, selection, train_step and publish, no broker; each step on-policy, one torch thread pool over every
core). ``--seeds`` runs of each, one after the other; the demo base of each seed is built (or found in the
cache) before, so neither pays for it.

Both stop after ``--max-steps`` learner steps (no evaluation during a run: it would take CPU from one side)
and write a PEFT adapter every ``--adapter-every`` versions; afterwards the adapters are evaluated in order with
the demo's held-out evaluation (deploy/evaluate.py: greedy, ``eval.num_prompts`` prompts) until one reaches
``--target``. For each side:

- start-up: loraflow from its first process start to the pipeline being up (the learner and a worker both past
  ``starting`` in their timelines); the reference from its process start to its first generate;
- training wall: from there to the moment the learner (the loop) produced the first adapter at the target;
- samples: the samples of the batches the steps up to that adapter trained on (groups x group size).

Where loraflow's time goes, over its training window: each process's share of each timeline state (busy =
generating, scoring, training, publishing), the learner's mean per-step wait / compute / policy check /
publish / checkpoint (learner/metrics.jsonl), and the reference's generate / train / publish per step.

Last line: value = loraflow's training seconds to target (median over seeds), reference = the single
process's, ``ratio`` = median over seeds of loraflow / reference (< 1: loraflow is faster), ``samples_ratio``
the same for samples.

    .venv/bin/python -m bench.time_to_accuracy [--seeds 0,1,2] [--target 0.9] [--max-steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench import accuracy_runs as runs
from bench import harness


def reference_side(run_dir: Path, out: Path, args: argparse.Namespace) -> runs.Side:
    """bench/single_process.py in its own process on the loraflow run's resolved config."""
    command = [sys.executable, "-m", "bench.single_process", "--config", str(run_dir / "config.toml"),
               "--steps", str(args.max_steps), "--out", str(out), "--adapter-every", str(args.adapter_every),
               "--threads", str(args.threads)]
    side, ref = runs.child_side("single process", command, out, args.max_duration + 300)
    side.breakdown = {f"reference_{key}_per_step": round(statistics.fmean(s[key] for s in ref["steps"]), 4)
                      for key in ("generate_s", "train_s", "publish_s")}
    return side


def main() -> None:
    parser = runs.race_parser(__doc__)
    parser.add_argument("--threads", type=int, default=0, help="the reference's torch threads (0 = every core)")
    args = harness.parse(parser, None, seeds="0", target=0.0, max_steps=2, max_duration=120.0, num_prompts=4)
    races = runs.race(args, lambda run_dir, tmp, seed, base: reference_side(run_dir, tmp / f"reference-{seed}", args))
    runs.print_races(races, "reference")
    breakdown = {**runs.median_breakdown([r.ours for r in races]), **runs.median_breakdown([r.peer for r in races])}
    runs.race_report("time_to_accuracy", races, args.target, "reference",
                     loraflow_startup_s=round(runs.median_of(races, lambda r: r.ours.startup_s), 2),
                     reference_startup_s=round(runs.median_of(races, lambda r: r.peer.startup_s), 2),
                     breakdown=breakdown)

if __name__ == "__main__":
    main()
