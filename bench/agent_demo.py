"""The agent demo at max_staleness 0 and at its default, side by side: wall time to a held-out accuracy target.

    .venv/bin/python -m bench.agent_demo [--seed 0] [--target 0.8] [--max-duration 150]

``loraflow run deploy/configs/agent-demo.toml`` twice, same seed, one after the other: ``--max-staleness 0`` and
the config's own. The harness's tool latency is heavy-tailed (``--tool-median-s``, ``--tool-sigma``), so a
synchronous step waits for its slowest episode while async workers play on. The base is built (or cached)
first; each run saves an adapter every ``--adapter-every`` versions until ``--max-duration``, then the adapters
are evaluated in order (deploy/agent_eval.py, ``--num-prompts``) until one reaches ``--target``: its time is when
the learner produced it, from the run's first process start. Value: async seconds to target; reference: sync.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import harness
from bench.accuracy_runs import REPO, Side, child_env, describe, loraflow_side, run_loraflow
from loraflow.common.config import load_config
from loraflow.deploy.agent_base import ensure_agent_base, ensure_quick_agent_base

CONFIG = REPO / "deploy" / "configs" / "agent-demo.toml"


def run_demo(run_dir: Path, args: argparse.Namespace, base: Path, max_staleness: int) -> None:
    argv = [str(CONFIG), "--run-dir", str(run_dir), "--seed", str(args.seed), "--model", str(base),
            "--max-staleness", str(max_staleness),
            "--max-duration", str(args.max_duration), "--set", f"learner.save_adapter_every={args.adapter_every}",
            "--set", "eval.num_prompts=0", "--set", f"run.num_steps={args.max_steps}"]
    env = child_env(OMP_NUM_THREADS="1", LORAFLOW_AGENT_TOOL_MEDIAN_S=str(args.tool_median_s),
                    LORAFLOW_AGENT_TOOL_SIGMA=str(args.tool_sigma))
    run_loraflow(argv, max_staleness=max_staleness, env=env, timeout_s=args.max_duration + 300)


def timed_run(args: argparse.Namespace, base: Path, max_staleness: int) -> Side:
    """One run at ``max_staleness``, its adapters evaluated in order (deploy/agent_eval.py) to ``args.target``."""
    from loraflow.deploy.agent_eval import evaluate_agent

    with tempfile.TemporaryDirectory(prefix="bench-agent-demo-") as tmp:
        run_dir = Path(tmp) / "run"
        run_demo(run_dir, args, base, max_staleness)
        config = load_config(run_dir / "config.toml")
        side = loraflow_side(run_dir, config, name=f"max_staleness {max_staleness}")
        side.reach(args.target, lambda path: evaluate_agent(config, path, num_prompts=args.num_prompts,
                                                            device="cpu").accuracy)
    print(describe(side), flush=True)
    return side


def main() -> None:
    parser = harness.flags(harness.parser(__doc__), {
        "seed": 0, "target": 0.8, "max_duration": (150.0, "per run, seconds"),
        "max_steps": (0, "learner steps per run (0: until --max-duration)"),
        "adapter_every": (2, "save a PEFT adapter every N versions"),
        "num_prompts": (100, "held-out prompts per adapter evaluation"),
        "tool_median_s": (0.2, "the tool's median latency, seconds"), "tool_sigma": (1.5, "the lognormal's sigma")})
    args = harness.parse(parser, None, target=0.0, max_steps=2, max_duration=60.0, num_prompts=4,
                         tool_median_s=0.02)  # --quick: the code path; the tool's tail is the full run's subject
    demo = load_config(CONFIG)
    base = ensure_quick_agent_base(args.seed) if args.quick else ensure_agent_base(args.seed)
    print(f"agent demo base for seed {args.seed}: {base}", flush=True)

    sync, async_ = (timed_run(args, base, m) for m in (0, demo.run.max_staleness))
    if sync.seconds_to_target is None or async_.seconds_to_target is None:
        raise SystemExit("a run did not reach the target; raise --max-duration or lower --target")
    sync_s, async_s = (side.startup_s + side.seconds_to_target for side in (sync, async_))  # from the first start
    harness.report("agent_demo", f"seconds_to_{args.target:.2f}_staleness_{demo.run.max_staleness}",
                   async_s, "s", sync_s, ratio=async_s / sync_s, seed=args.seed,
                   tool_median_s=args.tool_median_s, tool_sigma=args.tool_sigma,
                   sync_seconds_per_step=round(sync.seconds_per_step, 3),
                   async_seconds_per_step=round(async_.seconds_per_step, 3),
                   sync_version_at_target=sync.version_at_target, async_version_at_target=async_.version_at_target)


if __name__ == "__main__":
    main()
