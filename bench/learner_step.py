"""Learner step time split (wait / compute / publish) and trained tokens/s, 1 rank vs 2 ranks, on this CPU.

A real broker (``python -m broker``) is kept full by a producer thread that plays a rollout worker with
synthetic groups (random tokens of the tiny model's vocabulary, log-probs near its uniform policy), so the
learner never starves and the figures describe the learner. The learner runs ``--steps`` steps on the tiny
model twice: as one process and under ``torchrun --nproc_per_node=2``, one torch thread per rank (on a busy
2-core box, two OpenMP threads in one process spin against each other and run several times slower than one).
Per-step figures come from its ``metrics.jsonl``; the first ``--warmup`` steps are dropped.

Last line: value = trained tokens/s with 2 ranks, reference = with 1 rank, same batches, same run.

    .venv/bin/python bench/learner_step.py [--steps 30] [--groups 16] [--group-size 8] [--ranks 1,2]
        [--set learner.activation_checkpointing=\"on\"] [--set learner.micro_batch_tokens=512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import report  # noqa: E402
from common.tiny_model import resolve_model  # noqa: E402
from tests.learner.scripted import Producer  # noqa: E402
from tests.support import Processes, child_env, start_broker  # noqa: E402


def run_learner(tmp: Path, model_dir: Path, ranks: int, args: argparse.Namespace) -> list[dict]:
    """One broker + producer + learner run; returns the learner's per-step metrics."""
    procs = Processes(tmp)
    run_dir = tmp / f"run-{ranks}"
    settings = [f"run.groups_per_step={args.groups}", f"run.group_size={args.group_size}", "run.max_staleness=1",
                f"model.path=\"{model_dir}\"", "learner.checkpoint_every=0", "learner.save_adapter_every=0",
                f"learner.lora_rank={args.rank}", *args.settings]
    producer = None
    try:
        broker = start_broker(procs, *settings, name=f"broker-{ranks}", run_dir=run_dir)
        producer = Producer(broker.endpoint, max_prompt=args.max_prompt, max_completion=args.max_completion)
        producer.start()
        learner_args = ["-m", "learner", "--run-dir", str(run_dir), "--endpoint", broker.endpoint,
                        "--num-steps", str(args.steps)]
        for setting in settings:
            learner_args += ["--set", setting]
        if ranks == 1:
            argv = [sys.executable, *learner_args]
            env = child_env(OMP_NUM_THREADS=str(args.threads))
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                    *learner_args]
            env = child_env(OMP_NUM_THREADS="1")
        learner = procs.spawn(f"learner-{ranks}", argv, env=env)
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
    def median(key: str) -> float:
        return statistics.median(m[key] for m in lines)

    compute_s = sum(m["compute_s"] for m in lines)
    return {
        "wait_ms": 1000 * median("wait_s"),
        "compute_ms": 1000 * median("compute_s"),
        "publish_ms": 1000 * median("publish_s"),
        "step_ms": 1000 * statistics.median(m["wait_s"] + m["compute_s"] + m["publish_s"] for m in lines),
        "tokens_per_step": statistics.mean(m["num_tokens"] for m in lines),
        "positions_per_step": statistics.mean(m["num_positions"] for m in lines),
        "tokens_per_s": sum(m["num_tokens"] for m in lines) / compute_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--groups", type=int, default=16, help="groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=12)
    parser.add_argument("--max-completion", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the 1-rank run (ranks get 1)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help='extra settings of both runs, e.g. learner.activation_checkpointing="on"')
    parser.add_argument("--ranks", default="1,2", help="which runs (comma-separated rank counts)")
    args = parser.parse_args()
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
