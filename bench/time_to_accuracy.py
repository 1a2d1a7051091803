"""Wall time to the demo's accuracy target: synchronous (max_staleness 0) vs the default async setting.

The real thing: ``loraflow run`` on the demo config (tiny model warmed up by deploy/demo_base.py, 2 hf workers,
the learner, the broker), once with ``--max-staleness 0`` and once with the demo's own setting, same seed, same
machine, one after the other. The demo base is built (or loaded from the cache) before either run, so neither
pays for it. Each run writes a PEFT adapter every ``--adapter-every`` versions and stops at the target (its
periodic evaluation) or at ``--max-duration``; afterwards every saved adapter is evaluated (greedy, the demo's
held-out prompts) and the time to target is when the learner produced the first adapter that reaches it,
counted from the start of the first process of the run (start-up included, the same for both).

Last line: value = async seconds to target, reference = sync seconds to target (ratio < 1: async is faster).

    .venv/bin/python bench/time_to_accuracy.py [--seed 0] [--target 0.9] [--max-duration 240]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.accuracy_runs import child_env, compare, run_loraflow  # noqa: E402
from bench.report import report  # noqa: E402
from common.config import Config, load_config  # noqa: E402
from common.tasks import load_task  # noqa: E402
from deploy.demo_base import ensure_demo_base  # noqa: E402
from deploy.launcher import DEMO_CONFIG  # noqa: E402


def run_demo(run_dir: Path, args: argparse.Namespace, max_staleness: int) -> None:
    argv = ["--run-dir", str(run_dir), "--seed", str(args.seed), "--max-staleness", str(max_staleness),
            "--target-accuracy", str(args.target), "--max-duration", str(args.max_duration),
            "--set", f"learner.save_adapter_every={args.adapter_every}", "--set", "eval.every_s=10",
            "--set", "run.num_steps=0"]
    run_loraflow(argv, max_staleness=max_staleness, env=child_env(), timeout_s=args.max_duration + 300,
                 show=("stopping:", "base accuracy:", "final accuracy:"))


def evaluate(config: Config, version: int, path: Path) -> float:
    """Greedy accuracy of one saved adapter on the demo's held-out prompts."""
    from deploy.evaluate import evaluate as evaluate_model
    from deploy.evaluate import load_model

    task = load_task(config.run.task, config.run.seed, config.data)
    model, tokenizer = load_model(config.model.path, path)
    return evaluate_model(model, tokenizer, task, num_prompts=config.eval.num_prompts,
                          max_new_tokens=config.worker.max_new_tokens).accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=load_config(DEMO_CONFIG).eval.target_accuracy)
    parser.add_argument("--max-duration", type=float, default=240.0, help="per run, seconds")
    parser.add_argument("--adapter-every", type=int, default=5, help="save a PEFT adapter every N versions")
    args = parser.parse_args()
    demo = load_config(DEMO_CONFIG)
    print(f"demo base for seed {args.seed}: {ensure_demo_base(args.seed)}", flush=True)
    sync, async_ = compare((0, demo.run.max_staleness), prefix="bench-tta-",
                           run=lambda run_dir, m: run_demo(run_dir, args, m), target=args.target,
                           max_duration_s=args.max_duration, evaluate=evaluate)
    report("time_to_accuracy", f"seconds_to_{args.target:.2f}_staleness_{async_.max_staleness}",
           async_.seconds_to_target, "s", sync.seconds_to_target, seed=args.seed,
           sync_seconds_per_step=round(sync.seconds_per_step, 3),
           async_seconds_per_step=round(async_.seconds_per_step, 3))


if __name__ == "__main__":
    main()
