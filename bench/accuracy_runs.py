"""Races to a held-out accuracy target, shared by bench/time_to_accuracy.py, bench/vs_trl.py and bench/agent_demo.py.

A :class:`Side` is one run read back from what it left: when each version's parameters existed, the samples
trained up to it and the PEFT adapters it saved (:func:`loraflow_side` for a ``loraflow run``, :func:`child_side`
for a single process that writes ``result.json``). After the run its adapters are evaluated in version order
(:meth:`Side.reach`, off every clock) and the first at the target sets its training seconds and samples, timed
from its pipeline being up; ``startup_s`` is the time before that. :func:`race` is the per-seed loop of the demo
against a peer, :func:`print_races` its table.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import harness
from bench.report import report
from loraflow.common.config import Config, load_config
from loraflow.common.tasks import load_task
from loraflow.deploy import rundir
from loraflow.deploy.demo_base import ensure_demo_base, ensure_quick_base
from loraflow.deploy.launcher import DEMO_CONFIG
from tests.support import child_env

REPO = Path(__file__).resolve().parent.parent


@dataclass(slots=True, kw_only=True)
class Side:
    """One run of one side, timed to the target from its pipeline being up (``train_start_unix``)."""

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

    def reach(self, target: float, evaluate: Callable[[Path], float]) -> None:
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


def step_s(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


def run_loraflow(argv: Sequence[str], *, max_staleness: int, env: dict[str, str], timeout_s: float,
                 show: tuple[str, ...] = ("stopping:",)) -> None:
    """``python -m loraflow.deploy.cli run`` + ``argv``; prints the output lines that start with ``show``."""
    result = subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "run", *argv], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"loraflow run (max_staleness {max_staleness}) failed:\n{result.stdout}\n{result.stderr}")
    lines = [line for line in result.stdout.splitlines() if line.startswith(show)]
    print(f"max_staleness {max_staleness}: " + "; ".join(lines), flush=True)


# -- a loraflow run ---------------------------------------------------------------------------------------------


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


def loraflow_side(run_dir: Path, config: Config, name: str = "loraflow") -> Side:
    starts = [e["t"] for e in rundir.read_jsonl(rundir.processes_path(run_dir)) if e["event"] == "start"]
    lanes = rundir.timelines(run_dir)
    learner_ready = first_ready_unix(lanes["learner"])
    workers_ready = [t for name, lane in lanes.items() if name.startswith("worker-")
                     if (t := first_ready_unix(lane)) is not None]
    assert learner_ready is not None and workers_ready, f"{run_dir}: the learner or every worker never started"
    train_start = max(learner_ready, min(workers_ready))
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    adapters = sorted((int(p.name[1:]), p) for p in rundir.adapters_root(run_dir).glob("v*")
                      if (p / "adapter_config.json").is_file())
    return Side(name=name, startup_s=train_start - min(starts), train_start_unix=train_start, adapters=adapters,
                **timeline(steps, [s["num_groups"] * config.run.group_size for s in steps]))


def timeline(steps: list[dict], num_samples: list[int]) -> dict:
    """A Side's ``made_at``, ``samples_at`` and ``seconds_per_step`` from its step lines and samples per step."""
    made_at, samples_at, total = {}, {}, 0
    for s, n in zip(steps, num_samples, strict=True):
        total += n
        made_at[s["version"]] = s["time_unix"]
        samples_at[s["version"]] = total
    return {"made_at": made_at, "samples_at": samples_at, "seconds_per_step": step_s([s["time_unix"] for s in steps])}


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


# -- a single process -------------------------------------------------------------------------------------------


def child_side(name: str, command: list[str], out: Path, timeout_s: float) -> tuple[Side, dict]:
    """Run a single-process side (``command``, which writes ``out/result.json``: its steps and adapters) and read
    it back as a :class:`Side`; also the raw record."""
    result = subprocess.run(command, env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"the {name} side failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    ref = json.loads((out / "result.json").read_text())
    return Side(name=name, startup_s=ref["startup_s"], train_start_unix=ref["started_unix"],
                adapters=sorted((int(v), Path(p)) for v, p in ref["adapters"].items()),
                **timeline(ref["steps"], [s["num_samples"] for s in ref["steps"]])), ref


# -- evaluation --------------------------------------------------------------------------------------------------


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


# -- the demo against a peer, per seed ------------------------------------------------------------------------


@dataclass(slots=True)
class Race:
    seed: int
    ours: Side
    peer: Side

    @property
    def ratio(self) -> float:
        return self.ours.seconds_to_target / max(self.peer.seconds_to_target, 1e-9)

    @property
    def samples_ratio(self) -> float:
        return self.ours.samples_to_target / self.peer.samples_to_target


def race_parser(doc: str | None) -> argparse.ArgumentParser:
    """The flags of a race (:func:`race`), on :func:`bench.harness.parser`; the demo's config gives the defaults."""
    demo = load_config(DEMO_CONFIG)
    parser = harness.flags(harness.parser(doc), {
        "seeds": ("0,1,2", "comma-separated run.seed values (each its own base)"),
        "target": float(demo.eval.target_accuracy), "max_steps": (100, "learner steps of each side"),
        "max_duration": (240.0, "per loraflow run, seconds"),
        "adapter_every": (2, "save a PEFT adapter every N versions/steps"),
        "num_prompts": (demo.eval.num_prompts, "held-out prompts")})
    parser.add_argument("--max-staleness", type=int, default=None, help="loraflow's (default: the demo's)")
    parser.add_argument("--set", action="append", default=[], help="a config override for both sides")
    return parser


def race(args: argparse.Namespace, peer: Callable[[Path, Path, int, Path], Side]) -> list[Race]:
    """For each of ``args.seeds``: the demo (:func:`run_demo`), then ``peer(run_dir, scratch, seed, base)`` on the
    same base and resolved config; both sides' adapters evaluated to ``args.target``, loraflow's breakdown kept."""
    races = []
    with tempfile.TemporaryDirectory(prefix="bench-race-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            base = demo_base(args, seed)
            print(f"seed {seed}: demo base {base}; load average {os.getloadavg()[0]:.1f}", flush=True)
            run_dir = Path(tmp) / f"loraflow-{seed}"
            run_demo(run_dir, args, seed, base)
            config = load_config(run_dir / "config.toml")
            ours, other = loraflow_side(run_dir, config), peer(run_dir, Path(tmp), seed, base)
            evaluate = make_evaluate(config, args.num_prompts)
            for side in (ours, other):
                side.reach(args.target, evaluate)
                print(f"seed {seed} {describe(side)}", flush=True)
            if ours.seconds_to_target is None or other.seconds_to_target is None:
                raise SystemExit("a side did not reach the target; raise --max-steps or lower --target")
            ours.breakdown = loraflow_breakdown(run_dir, ours)
            print(f"seed {seed} where the time went: " + json.dumps({**ours.breakdown, **other.breakdown}), flush=True)
            races.append(Race(seed, ours, other))
    return races


def print_races(races: list[Race], peer: str) -> None:
    print()
    harness.table(["seed", "loraflow start-up", "loraflow training to target", "samples", f"{peer} start-up",
                   f"{peer} training", "samples", "ratio", "samples ratio"],
                  [[r.seed, f"{r.ours.startup_s:.1f} s", f"{r.ours.seconds_to_target:.1f} s (v{r.ours.version_at_target})",
                    r.ours.samples_to_target, f"{r.peer.startup_s:.1f} s",
                    f"{r.peer.seconds_to_target:.1f} s (v{r.peer.version_at_target})", r.peer.samples_to_target,
                    f"{r.ratio:.2f}", f"{r.samples_ratio:.2f}"] for r in races])


def median_of(races: list[Race], figure: Callable[[Race], float]) -> float:
    return statistics.median(figure(r) for r in races)


def median_breakdown(sides: list[Side]) -> dict[str, float]:
    return {key: round(statistics.median(s.breakdown.get(key, 0.0) for s in sides), 4) for key in sides[0].breakdown}


def race_report(bench: str, races: list[Race], target: float, peer: str, **extra: object) -> None:
    """The race's JSON line: value = loraflow's median training seconds to ``target``, reference = the peer's,
    ``ratio`` and ``samples_ratio`` (medians over seeds), per-seed lists and s/step under ``loraflow_*`` and
    ``<peer>_*`` names, then ``extra``."""
    def median(figure: Callable[[Race], float], digits: int) -> float:
        return round(median_of(races, figure), digits)

    sides = {"loraflow": lambda r: r.ours, peer: lambda r: r.peer}
    report(bench, f"training_s_to_{target:.2f}", median_of(races, lambda r: r.ours.seconds_to_target), "s",
           median_of(races, lambda r: r.peer.seconds_to_target), ratio=median_of(races, lambda r: r.ratio),
           samples_ratio=median(lambda r: r.samples_ratio, 4), seeds=[r.seed for r in races],
           **{f"{name}_s": [round(side(r).seconds_to_target, 2) for r in races] for name, side in sides.items()},
           **{f"{name}_samples": [side(r).samples_to_target for r in races] for name, side in sides.items()},
           **{f"{name}_s_per_step": median(lambda r, side=side: side(r).seconds_per_step, 4)
              for name, side in sides.items()},
           load_average=round(os.getloadavg()[0], 2), **extra)
