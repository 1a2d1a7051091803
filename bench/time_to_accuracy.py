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
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench import harness
from bench.accuracy_runs import REPO, child_env, run_loraflow
from bench.report import report
from loraflow.common.config import Config, load_config
from loraflow.common.tasks import load_task
from loraflow.deploy import rundir
from loraflow.deploy.demo_base import ensure_demo_base, ensure_quick_base
from loraflow.deploy.launcher import DEMO_CONFIG


@dataclass(slots=True, kw_only=True)
class Side:
    """One run of one side, timed to the target."""

    name: str
    startup_s: float
    train_start_unix: float
    made_at: dict[int, float]               # version -> unix time its parameters existed
    samples_at: dict[int, int]              # version -> samples trained on up to it
    adapters: list[tuple[int, Path]]        # (version, PEFT dir), in order
    seconds_to_target: float | None = None
    samples_to_target: int | None = None
    version_at_target: int | None = None
    accuracies: dict[int, float] = field(default_factory=dict)
    seconds_per_step: float = float("nan")
    breakdown: dict[str, float] = field(default_factory=dict)

    def reach(self, target: float, evaluate) -> None:  # noqa: ANN001 - (version, path) -> accuracy
        """Evaluate the adapters in order; the first at the target sets the times."""
        for version, path in self.adapters:
            if version not in self.made_at:
                continue
            accuracy = self.accuracies[version] = evaluate(path)
            print(f"  {self.name} v{version}: {accuracy:.1%}", flush=True)
            if accuracy >= target:
                self.seconds_to_target = self.made_at[version] - self.train_start_unix
                self.samples_to_target = self.samples_at[version]
                self.version_at_target = version
                return


# -- loraflow ----------------------------------------------------------------------------------------------------


def demo_base(args: argparse.Namespace, seed: int) -> Path:
    """The demo base of ``seed``: the demo's own, or with ``--quick`` the quick recipe's (the code path)."""
    return ensure_quick_base(seed) if args.quick else ensure_demo_base(seed)


def run_demo(run_dir: Path, args: argparse.Namespace, seed: int, base: Path) -> None:
    argv = ["--run-dir", str(run_dir), "--seed", str(seed), "--model", str(base),
            "--max-duration", str(args.max_duration),
            "--set", f"learner.save_adapter_every={args.adapter_every}", "--set", "eval.num_prompts=0",
            "--set", f"run.num_steps={args.max_steps}", *(f"--set={s}" for s in args.set)]
    if args.max_staleness is not None:
        argv += ["--max-staleness", str(args.max_staleness)]
    staleness = args.max_staleness if args.max_staleness is not None else load_config(DEMO_CONFIG).run.max_staleness
    run_loraflow(argv, max_staleness=staleness, env=child_env(), timeout_s=args.max_duration + 300)


def first_ready_unix(lane: rundir.Lane) -> float | None:
    return next((start for start, _, state in lane.spans() if state != "starting"), None)


def loraflow_side(run_dir: Path, config: Config) -> Side:
    starts = [e["t"] for e in rundir.read_jsonl(rundir.processes_path(run_dir)) if e["event"] == "start"]
    lanes = rundir.timelines(run_dir)
    learner_ready = first_ready_unix(lanes["learner"])
    workers_ready = [t for name, lane in lanes.items() if name.startswith("worker-")
                     if (t := first_ready_unix(lane)) is not None]
    assert learner_ready is not None and workers_ready, f"{run_dir}: the learner or every worker never started"
    train_start = max(learner_ready, min(workers_ready))
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    made_at, samples_at, total = {}, {}, 0
    for s in steps:
        total += s["num_groups"] * config.run.group_size
        made_at[s["version"]] = s["time_unix"]
        samples_at[s["version"]] = total
    adapters = sorted((int(p.name[1:]), p) for p in rundir.adapters_root(run_dir).glob("v*")
                      if (p / "adapter_config.json").is_file())
    return Side(name="loraflow", startup_s=train_start - min(starts), train_start_unix=train_start,
                made_at=made_at, samples_at=samples_at, adapters=adapters,
                seconds_per_step=step_s([s["time_unix"] for s in steps]))


def loraflow_breakdown(run_dir: Path, side: Side) -> dict[str, float]:
    """Where loraflow's training window went: state shares per process, the learner's mean phase times."""
    end = side.made_at[side.version_at_target] if side.version_at_target is not None else max(side.made_at.values())
    begin = side.train_start_unix
    out: dict[str, float] = {}
    for name, lane in rundir.timelines(run_dir).items():
        if name == "broker":
            continue
        shares: dict[str, float] = defaultdict(float)
        for start, stop, state in lane.spans():
            overlap = min(stop, end) - max(start, begin)
            if overlap > 0:
                shares[state] += overlap / (end - begin)
        key = "learner" if name == "learner" else "worker" + name.rsplit("-", 1)[-1][-2:]
        for state, share in sorted(shares.items()):
            out[f"{key}_{state}_share"] = round(share, 3)
        out[f"{key}_busy_share"] = round(sum(v for k, v in shares.items() if k in rundir.BUSY_STATES), 3)
        idle = [stop - start for start, stop, state in lane.spans() if state == "idle" and begin <= start < end]
        if name != "learner" and idle:  # idle: no lease in hand and none asked for (an empty grant's back-off)
            out[f"{key}_idle_spans"] = len(idle)
            out[f"{key}_idle_span_median_ms"] = round(statistics.median(idle) * 1e3, 1)
    steps = [s for s in rundir.read_jsonl(rundir.metrics_path(run_dir)) if s["time_unix"] <= end]
    for key in ("wait_s", "compute_s", "integrity_s", "publish_s", "checkpoint_s"):
        out[f"learner_{key}_per_step"] = round(statistics.fmean(s[key] for s in steps), 4) if steps else 0.0
    published = {s["version"]: s["time_unix"] for s in steps}
    loads = [(version, at, load_ms) for version, at, load_ms in adapter_loads(run_dir) if version in published]
    if loads:  # the hot-swap: the learner's step line (after its publish) -> a worker has the version loaded
        out["publish_to_loaded_ms_median"] = round(statistics.median((at - published[v]) * 1e3 for v, at, _ in loads), 1)
        out["adapter_load_ms_median"] = round(statistics.median(ms for _, _, ms in loads), 1)
    return out


def adapter_loads(run_dir: Path) -> list[tuple[int, float, float]]:
    """(version, unix time, load_ms) of every ``adapter_loaded`` line in the workers' logs (UTC timestamps)."""
    out = []
    for path in sorted((run_dir / "logs").glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if " adapter_loaded " not in line:
                continue
            fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
            try:
                at = datetime.datetime.fromisoformat(line.split()[0]).replace(tzinfo=datetime.UTC).timestamp()
                out.append((int(fields["version"]), at, float(fields["load_ms"])))
            except (KeyError, ValueError):
                continue
    return out


# -- the reference -------------------------------------------------------------------------------------------


def child_side(name: str, command: list[str], out: Path, timeout_s: float) -> tuple[Side, dict]:
    """Run a single-process side (``command``, which writes ``out/result.json``: its steps and adapters) and read
    it back as a :class:`Side`; also the raw record."""
    result = subprocess.run(command, env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"the {name} side failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    ref = json.loads((out / "result.json").read_text())
    made_at, samples_at, total = {}, {}, 0
    for s in ref["steps"]:
        total += s["num_samples"]
        made_at[s["version"]] = s["time_unix"]
        samples_at[s["version"]] = total
    side = Side(name=name, startup_s=ref["startup_s"], train_start_unix=ref["started_unix"], made_at=made_at,
                samples_at=samples_at, adapters=sorted((int(v), Path(p)) for v, p in ref["adapters"].items()),
                seconds_per_step=step_s([s["time_unix"] for s in ref["steps"]]))
    return side, ref


def reference_side(run_dir: Path, out: Path, args: argparse.Namespace) -> Side:
    """bench/single_process.py in its own process on the loraflow run's resolved config."""
    command = [sys.executable, "-m", "bench.single_process", "--config", str(run_dir / "config.toml"),
               "--steps", str(args.max_steps), "--out", str(out), "--adapter-every", str(args.adapter_every),
               "--threads", str(args.threads)]
    side, ref = child_side("single process", command, out, args.max_duration + 300)
    side.breakdown = {f"reference_{key}_per_step": round(statistics.fmean(s[key] for s in ref["steps"]), 4)
                      for key in ("generate_s", "train_s", "publish_s")}
    return side


# -- the bench ---------------------------------------------------------------------------------------------------


def step_s(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


def make_evaluate(config: Config, num_prompts: int):  # noqa: ANN201
    from loraflow.deploy.evaluate import evaluate, load_model

    task = load_task(config.run.task, config.run.seed, config.data)

    def run(path: Path) -> float:
        model, tokenizer = load_model(config.model.path, path, device="cpu")
        return evaluate(model, tokenizer, task, num_prompts=num_prompts, max_new_tokens=config.worker.max_new_tokens,
                        chat_template_kwargs=config.model.chat_template_kwargs).accuracy

    return run


def describe(side: Side) -> str:
    if side.seconds_to_target is None:
        return (f"{side.name}: target not reached in {len(side.made_at)} steps "
                f"(best {max(side.accuracies.values(), default=0.0):.1%})")
    return (f"{side.name}: start-up {side.startup_s:.1f} s, training {side.seconds_to_target:.1f} s to "
            f"v{side.version_at_target}, {side.samples_to_target} samples, {side.seconds_per_step:.3f} s/step")


def main() -> None:
    demo = load_config(DEMO_CONFIG)
    parser = harness.parser(__doc__)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values (each its own base)")
    parser.add_argument("--target", type=float, default=demo.eval.target_accuracy)
    parser.add_argument("--max-steps", type=int, default=100, help="learner steps of each run")
    parser.add_argument("--max-duration", type=float, default=240.0, help="per loraflow run, seconds")
    parser.add_argument("--adapter-every", type=int, default=2, help="save a PEFT adapter every N versions")
    parser.add_argument("--num-prompts", type=int, default=demo.eval.num_prompts, help="held-out prompts")
    parser.add_argument("--threads", type=int, default=0, help="the reference's torch threads (0 = every core)")
    parser.add_argument("--max-staleness", type=int, default=None, help="loraflow's (default: the demo's)")
    parser.add_argument("--set", action="append", default=[], help="a config override for both sides")
    args = harness.parse(parser, None, seeds="0", target=0.0, max_steps=2, max_duration=120.0, num_prompts=4)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tta-") as tmp:
        for seed in seeds:
            base = demo_base(args, seed)
            print(f"seed {seed}: demo base {base}; load average {os.getloadavg()[0]:.1f}", flush=True)
            run_dir = Path(tmp) / f"loraflow-{seed}"
            run_demo(run_dir, args, seed, base)
            config = load_config(run_dir / "config.toml")
            ours = loraflow_side(run_dir, config)
            ref = reference_side(run_dir, Path(tmp) / f"reference-{seed}", args)
            evaluate = make_evaluate(config, args.num_prompts)
            for side in (ours, ref):
                side.reach(args.target, evaluate)
                print(f"seed {seed} {describe(side)}", flush=True)
            if ours.seconds_to_target is None or ref.seconds_to_target is None:
                raise SystemExit("a run did not reach the target; raise --max-steps or lower --target")
            ours.breakdown = loraflow_breakdown(run_dir, ours)
            print(f"seed {seed} where the time went: " + json.dumps({**ours.breakdown, **ref.breakdown}), flush=True)
            rows.append((seed, ours, ref))
    print("\n| seed | loraflow start-up | loraflow training to target | samples | reference start-up | "
          "reference training | samples | ratio | samples ratio |\n|---|---|---|---|---|---|---|---|---|")
    for seed, ours, ref in rows:
        print(f"| {seed} | {ours.startup_s:.1f} s | {ours.seconds_to_target:.1f} s (v{ours.version_at_target}) | "
              f"{ours.samples_to_target} | {ref.startup_s:.1f} s | {ref.seconds_to_target:.1f} s "
              f"(v{ref.version_at_target}) | {ref.samples_to_target} | "
              f"{ours.seconds_to_target / ref.seconds_to_target:.2f} | "
              f"{ours.samples_to_target / ref.samples_to_target:.2f} |")
    median = statistics.median
    breakdown = {key: round(median(o.breakdown.get(key, 0.0) for _, o, _ in rows), 4) for key in rows[0][1].breakdown}
    breakdown.update({key: round(median(r.breakdown[key] for _, _, r in rows), 4) for key in rows[0][2].breakdown})
    report("time_to_accuracy", f"training_s_to_{args.target:.2f}",
           median(o.seconds_to_target for _, o, _ in rows), "s", median(r.seconds_to_target for _, _, r in rows),
           ratio=median(o.seconds_to_target / r.seconds_to_target for _, o, r in rows),
           samples_ratio=round(median(o.samples_to_target / r.samples_to_target for _, o, r in rows), 4),
           seeds=seeds, loraflow_s=[round(o.seconds_to_target, 2) for _, o, _ in rows],
           reference_s=[round(r.seconds_to_target, 2) for _, _, r in rows],
           loraflow_samples=[o.samples_to_target for _, o, _ in rows],
           reference_samples=[r.samples_to_target for _, _, r in rows],
           loraflow_startup_s=round(median(o.startup_s for _, o, _ in rows), 2),
           reference_startup_s=round(median(r.startup_s for _, _, r in rows), 2),
           loraflow_s_per_step=round(median(o.seconds_per_step for _, o, _ in rows), 4),
           reference_s_per_step=round(median(r.seconds_per_step for _, _, r in rows), 4),
           load_average=round(os.getloadavg()[0], 2), breakdown=breakdown)


if __name__ == "__main__":
    main()
