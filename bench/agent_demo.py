"""The agent demo at max_staleness 0 and at its default, side by side: wall time to a held-out accuracy target.

The real thing: ``loraflow run deploy/configs/agent-demo.toml`` (the tiny agent base of deploy/agent_base.py,
2 hf workers whose gateways serve the harness deploy/agents/agent_demo.py, the learner, the broker), once with
``--max-staleness 0`` and once with the config's own setting, same seed, same machine, one after the other.
The tool's latency is the harness's heavy-tailed lognormal (``--tool-median-s``, ``--tool-sigma``: some calls
take 10-50x the median), so a synchronous step waits for its slowest episode while async workers keep playing.
The base is built (or found in the cache) before either run, so neither pays for it. Each run writes a PEFT
adapter every ``--adapter-every`` versions and stops at ``--max-duration`` (no evaluation during the run: it would
take CPU from one run and not the other); afterwards the saved adapters are evaluated in order through the
harness (deploy/agent_eval.py: greedy, ``--num-prompts`` held-out prompts, the tool's latency included) until
one reaches ``--target``. The time to target is when the learner produced that adapter, counted from the start
of the run's first process (start-up included, the same for both).

Last line: value = async seconds to target, reference = sync seconds to target, ratio = async / sync (< 1:
async is faster). A run that misses the target is an error (raise ``--max-duration`` or lower ``--target``).

    .venv/bin/python bench/agent_demo.py [--seed 0] [--target 0.8] [--max-duration 150]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import report  # noqa: E402
from common.config import load_config  # noqa: E402
from deploy import rundir  # noqa: E402
from deploy.agent_base import ensure_agent_base  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "deploy" / "configs" / "agent-demo.toml"


@dataclass(slots=True, kw_only=True)
class Outcome:
    max_staleness: int
    seconds_to_target: float | None
    version_at_target: int | None
    accuracies: dict[int, float]  # version -> held-out accuracy, the adapters evaluated
    steps: int
    seconds_per_step: float


def child_env(args: argparse.Namespace) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                LORAFLOW_AGENT_TOOL_MEDIAN_S=str(args.tool_median_s), LORAFLOW_AGENT_TOOL_SIGMA=str(args.tool_sigma))


def run_demo(run_dir: Path, args: argparse.Namespace, max_staleness: int) -> None:
    argv = [sys.executable, "-m", "deploy.cli", "run", str(CONFIG), "--run-dir", str(run_dir), "--seed",
            str(args.seed), "--max-staleness", str(max_staleness), "--max-duration", str(args.max_duration),
            "--set", f"learner.save_adapter_every={args.adapter_every}", "--set", "eval.num_prompts=0",
            "--set", "run.num_steps=0"]
    result = subprocess.run(argv, env=child_env(args), cwd=REPO, capture_output=True, text=True,
                            timeout=args.max_duration + 300)
    if result.returncode != 0:
        raise SystemExit(f"loraflow run (max_staleness {max_staleness}) failed:\n{result.stdout}\n{result.stderr}")
    stopped = [line for line in result.stdout.splitlines() if line.startswith("stopping:")]
    print(f"max_staleness {max_staleness}: {'; '.join(stopped)}", flush=True)


def time_to_target(run_dir: Path, args: argparse.Namespace, max_staleness: int) -> Outcome:
    """Evaluate the saved adapters in order; the first to reach the target, timed from the first process start."""
    from deploy.agent_eval import evaluate_agent

    config = load_config(run_dir / "config.toml")
    starts = [e["t"] for e in rundir.read_jsonl(rundir.processes_path(run_dir)) if e["event"] == "start"]
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    made_at = {s["version"]: s["time_unix"] for s in steps}
    adapters = sorted((int(p.name[1:]), p) for p in rundir.adapters_root(run_dir).glob("v*")
                      if (p / "adapter_config.json").is_file())
    accuracies: dict[int, float] = {}
    outcome = Outcome(max_staleness=max_staleness, seconds_to_target=None, version_at_target=None,
                      accuracies=accuracies, steps=len(steps), seconds_per_step=step_s(steps))
    for version, path in adapters:
        accuracies[version] = evaluate_agent(config, path, num_prompts=args.num_prompts, device="cpu").accuracy
        print(f"  max_staleness {max_staleness} v{version}: {accuracies[version]:.1%}", flush=True)
        if accuracies[version] >= args.target and version in made_at:
            outcome.seconds_to_target = made_at[version] - min(starts)
            outcome.version_at_target = version
            break
    return outcome


def step_s(steps: list[dict]) -> float:
    if len(steps) < 2:
        return float("nan")
    return (steps[-1]["time_unix"] - steps[0]["time_unix"]) / (len(steps) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--max-duration", type=float, default=150.0, help="per run, seconds")
    parser.add_argument("--adapter-every", type=int, default=2, help="save a PEFT adapter every N versions")
    parser.add_argument("--num-prompts", type=int, default=100, help="held-out prompts per adapter evaluation")
    parser.add_argument("--tool-median-s", type=float, default=0.2, help="the tool's median latency, seconds")
    parser.add_argument("--tool-sigma", type=float, default=1.5, help="the lognormal's sigma")
    args = parser.parse_args()
    demo = load_config(CONFIG)
    print(f"agent demo base for seed {args.seed}: {ensure_agent_base(args.seed)}", flush=True)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="bench-agent-demo-") as tmp:
        for max_staleness in (0, demo.run.max_staleness):
            run_dir = Path(tmp) / f"staleness-{max_staleness}"
            run_demo(run_dir, args, max_staleness)
            outcomes.append(time_to_target(run_dir, args, max_staleness))
            o = outcomes[-1]
            reached = (f"{o.seconds_to_target:.1f} s (v{o.version_at_target})" if o.seconds_to_target is not None
                       else f"not reached in {args.max_duration:.0f} s (best {max(o.accuracies.values(), default=0):.1%})")
            print(f"max_staleness {max_staleness}: target {args.target:.0%} {reached}; {o.steps} steps, "
                  f"{o.seconds_per_step:.2f} s/step", flush=True)
    sync, async_ = outcomes
    if sync.seconds_to_target is None or async_.seconds_to_target is None:
        raise SystemExit("a run did not reach the target; raise --max-duration or lower --target")
    report("agent_demo", f"seconds_to_{args.target:.2f}_staleness_{async_.max_staleness}",
           async_.seconds_to_target, "s", sync.seconds_to_target,
           ratio=async_.seconds_to_target / sync.seconds_to_target, seed=args.seed,
           tool_median_s=args.tool_median_s, tool_sigma=args.tool_sigma,
           sync_seconds_per_step=round(sync.seconds_per_step, 3),
           async_seconds_per_step=round(async_.seconds_per_step, 3),
           sync_version_at_target=sync.version_at_target, async_version_at_target=async_.version_at_target)


if __name__ == "__main__":
    main()
