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
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import report  # noqa: E402
from common.config import load_config  # noqa: E402
from common.tasks import load_task  # noqa: E402
from deploy import rundir  # noqa: E402
from deploy.demo_base import ensure_demo_base  # noqa: E402
from deploy.launcher import DEMO_CONFIG  # noqa: E402
from tests.support import child_env  # noqa: E402


@dataclass(slots=True, kw_only=True)
class Outcome:
    max_staleness: int
    seconds_to_target: float | None
    version_at_target: int | None
    best_accuracy: float
    steps: int
    seconds_per_step: float


def run_demo(run_dir: Path, args: argparse.Namespace, max_staleness: int) -> None:
    argv = [sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir), "--seed", str(args.seed),
            "--max-staleness", str(max_staleness), "--target-accuracy", str(args.target),
            "--max-duration", str(args.max_duration), "--set", f"learner.save_adapter_every={args.adapter_every}",
            "--set", "eval.every_s=10", "--set", "run.num_steps=0"]
    result = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=args.max_duration + 300)
    if result.returncode != 0:
        raise SystemExit(f"loraflow run (max_staleness {max_staleness}) failed:\n{result.stdout}\n{result.stderr}")
    lines = [line for line in result.stdout.splitlines() if line.startswith(("stopping:", "base accuracy:",
                                                                            "final accuracy:"))]
    print(f"max_staleness {max_staleness}: " + "; ".join(lines), flush=True)


def time_to_target(run_dir: Path, args: argparse.Namespace, max_staleness: int) -> Outcome:
    """Evaluate every saved adapter; the first to reach the target, timed from the run's first process start."""
    from deploy.evaluate import evaluate, load_model

    config = load_config(run_dir / "config.toml")
    task = load_task(config.run.task, config.run.seed, config.data)
    starts = [e["t"] for e in rundir.read_jsonl(rundir.processes_path(run_dir)) if e["event"] == "start"]
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    made_at = {s["version"]: s["time_unix"] for s in steps}
    adapters = sorted((int(p.name[1:]), p) for p in rundir.adapters_root(run_dir).glob("v*")
                      if (p / "adapter_config.json").is_file())
    best = 0.0
    for version, path in adapters:
        model, tokenizer = load_model(config.model.path, path)
        accuracy = evaluate(model, tokenizer, task, num_prompts=config.eval.num_prompts,
                            max_new_tokens=config.worker.max_new_tokens).accuracy
        best = max(best, accuracy)
        if accuracy >= args.target and version in made_at:
            return Outcome(max_staleness=max_staleness, seconds_to_target=made_at[version] - min(starts),
                           version_at_target=version, best_accuracy=accuracy, steps=len(steps),
                           seconds_per_step=_step_s(steps))
    return Outcome(max_staleness=max_staleness, seconds_to_target=None, version_at_target=None, best_accuracy=best,
                   steps=len(steps), seconds_per_step=_step_s(steps))


def _step_s(steps: list[dict]) -> float:
    if len(steps) < 2:
        return float("nan")
    return (steps[-1]["time_unix"] - steps[0]["time_unix"]) / (len(steps) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=load_config(DEMO_CONFIG).eval.target_accuracy)
    parser.add_argument("--max-duration", type=float, default=240.0, help="per run, seconds")
    parser.add_argument("--adapter-every", type=int, default=5, help="save a PEFT adapter every N versions")
    args = parser.parse_args()
    demo = load_config(DEMO_CONFIG)
    print(f"demo base for seed {args.seed}: {ensure_demo_base(args.seed)}", flush=True)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="bench-tta-") as tmp:
        for max_staleness in (0, demo.run.max_staleness):
            run_dir = Path(tmp) / f"staleness-{max_staleness}"
            run_demo(run_dir, args, max_staleness)
            outcomes.append(time_to_target(run_dir, args, max_staleness))
            o = outcomes[-1]
            reached = (f"{o.seconds_to_target:.1f} s (v{o.version_at_target})" if o.seconds_to_target is not None
                       else f"not reached in {args.max_duration:.0f} s (best {o.best_accuracy:.1%})")
            print(f"max_staleness {max_staleness}: target {args.target:.0%} {reached}; {o.steps} steps, "
                  f"{o.seconds_per_step:.2f} s/step", flush=True)
    sync, async_ = outcomes
    if sync.seconds_to_target is None or async_.seconds_to_target is None:
        raise SystemExit("a run did not reach the target; raise --max-duration or lower --target")
    report("time_to_accuracy", f"seconds_to_{args.target:.2f}_staleness_{async_.max_staleness}",
           async_.seconds_to_target, "s", sync.seconds_to_target, seed=args.seed,
           sync_seconds_per_step=round(sync.seconds_per_step, 3),
           async_seconds_per_step=round(async_.seconds_per_step, 3))


if __name__ == "__main__":
    main()
