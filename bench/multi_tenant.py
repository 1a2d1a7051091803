"""Many runs on one pool against the same runs one after another on it: experiments per hour, accuracy, isolation.

For each count N of ``--runs`` the same N demo runs (seed i, learning rate ``LRS[i]``, each stopping at
``--target`` held-out accuracy or after ``--max-steps`` steps) are run twice on a ``loraflow pool`` of the demo
base: one after another (each submitted when the previous one ended) and all at once (submitted together). Both
sides pay the same start-up per run (each run's learner and workers start when it is submitted).

    experiments_per_hour   runs that reached the target, per hour of the side's wall time (first submit to the
                           last run's end); ``ratio`` = all at once / one after another (the reference)
    accuracy_gap_points    per run, |final held-out accuracy alone - in the shared pool| in points, the max; at
                           the same sample budget, so only with ``--target 0`` (every run trains its
                           ``--max-steps`` steps; evaluated once, at its end, on ``--eval-prompts`` prompts);
                           with a target each run stops at its first evaluation past it: null
    isolation_violations   groups a run trained that a worker of another run submitted (the learner's ledger
                           names the worker of each trained group; a pool run's workers are ``<run>-<i>``, shared
                           workers ``shared-<i>``), and groups its learner refused for another adapter's evidence
                           (``policy_mismatch`` in its log)
    fairness               max over runs of |its share of the samples served while all N ran - 1/N| x N (equal
                           weights; samples = groups x group size of each learner step)

Each run has its own learner and ``--workers`` workers, or, with ``--shared-workers N``, every run is served by
the pool's N shared workers (one engine each; README.md "Many runs on one pool"); with ``--shared-learner`` one
learner process trains every run over one base. ``learner_peak_mib``: the most memory the learner processes held
together (VmRSS, sampled each second), per side. Every other figure comes from what the runs left in their
directories (metrics.jsonl, evals.jsonl, learner/ledger.jsonl, run_state.json).

    python -m bench.multi_tenant                 # N = 1, 4, 8 (about an hour on 2 cores)
    python -m bench.multi_tenant --runs 1,4      # the figures BENCHMARKS.md records
    python -m bench.multi_tenant --runs 4 --target 0 --max-steps 40 --eval-prompts 500   # accuracy_gap_points
    python -m bench.multi_tenant --quick         # two quick runs of a few steps on the quick base, one shared
                                                 # worker and learner: the code path
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import harness
from loraflow.deploy import rundir
from loraflow.deploy.demo_base import ensure_demo_base, ensure_quick_base
from loraflow.deploy.pool import read_state
from tests.fault.ledger import read_json_lines
from tests.support import child_env

LRS = (1e-3, 1.5e-3, 7e-4, 1.2e-3, 8e-4, 1e-3, 1.3e-3, 9e-4)
ENDED = ("finished", "cancelled", "failed")
SAMPLE_S = 1.0  # how often the learners' memory is sampled


def parse(argv: list[str] | None = None) -> Any:
    p = harness.parser(__doc__)
    harness.flags(p, dict(runs=("1,4,8", "comma-separated run counts N"),
                          target=(0.9, "held-out accuracy a run stops at (and counts as an experiment reaching)"),
                          max_steps=(150, "learner steps a run may take at most"),
                          workers=(1, "workers per run"),
                          shared_workers=(0, "workers serving every run in one engine (0: each run its own)"),
                          eval_prompts=(100, "held-out prompts per evaluation"),
                          timeout_s=(3600.0, "one side's wall time at most")))
    p.add_argument("--shared-learner", action="store_true", help="one learner process training every run over "
                   "one base (else each run its own learner)")
    return harness.parse(p, argv, runs="2", target=0.0, max_steps=2, eval_prompts=8, timeout_s=600.0,
                         shared_workers=1, shared_learner=True)


class PoolSide:
    """One ``loraflow pool`` process and the runs submitted to it."""

    def __init__(self, directory: Path, base: Path, args: Any) -> None:
        self.directory, self.args = directory, args
        log = open(directory.with_suffix(".log"), "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraflow.deploy.cli", "pool", "--model", str(base), "--run-dir", str(directory),
             "--workers", str(args.workers), "--shared-workers", str(args.shared_workers),
             *(["--shared-learner"] if args.shared_learner else []), "--log-format", "json",
             "--set", f"eval.num_prompts={args.eval_prompts}",
             "--set", f"eval.every_s={5 if args.target else 0}",  # periodic: only to see a target reached
             "--set", "launch.progress_every_s=60"],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
        self._wait(lambda: (directory / "config.toml").is_file() and (directory / "broker" / "endpoint").is_file(),
                   120, "the pool's broker")
        self.learner_peak_bytes = 0  # the most memory the learner processes held together (sampled)
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample_learners, daemon=True)
        self._sampler.start()

    def _sample_learners(self) -> None:
        while not self._sampling.wait(SAMPLE_S):
            pids = []
            for path in [self.directory, *self.directory.glob("runs/*")]:
                newest = {e["process"]: e["pid"] for e in rundir.read_jsonl(rundir.processes_path(path))
                          if e["event"] == "start" and e["process"] in ("learner", "learner-shared")}
                pids.extend(newest.values())
            held = 0
            for pid in pids:
                with contextlib.suppress(OSError, RuntimeError):  # ended since
                    held += harness.rss_bytes(pid)
            self.learner_peak_bytes = max(self.learner_peak_bytes, held)

    def submit(self, index: int) -> str:
        run_id = f"r{index}"
        subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "submit", "/dev/null", "--pool",
                        str(self.directory), "--id", run_id, *run_settings(self.args, index)], check=True,
                       capture_output=True, env=child_env())
        return run_id

    def run_dir(self, run_id: str) -> Path:
        return self.directory / "runs" / run_id

    def wait_ended(self, run_ids: list[str]) -> None:
        self._wait(lambda: all(read_state(self.run_dir(r)).get("state") in ENDED for r in run_ids),
                   self.args.timeout_s, f"runs {run_ids} to end")

    def _wait(self, condition: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"multi_tenant: the pool in {self.directory} stopped or timed out waiting for {what}; "
                                 f"see {self.directory.with_suffix('.log')}")
            time.sleep(0.5)

    def close(self) -> None:
        self._sampling.set()
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_settings(args: Any, index: int) -> list[str]:
    return ["--set", f"run.seed={index}", "--set", f"learner.lr={LRS[index % len(LRS)]}",
            "--set", f"run.num_steps={args.max_steps}", "--set", f"eval.target_accuracy={args.target}"]


def run_side(directory: Path, base: Path, args: Any, n: int, together: bool) -> dict[str, Any]:
    pool = PoolSide(directory, base, args)
    try:
        started = time.time()
        if together:
            run_ids = [pool.submit(i) for i in range(n)]
            pool.wait_ended(run_ids)
        else:
            run_ids = []
            for i in range(n):
                run_ids.append(pool.submit(i))
                pool.wait_ended(run_ids)
        wall_s = time.time() - started
    finally:
        pool.close()
    runs = {r: read_run(pool.run_dir(r), args.target) for r in run_ids}
    reached = sum(run["reached"] for run in runs.values())
    return {"wall_s": wall_s, "reached": reached, "per_hour": reached / (wall_s / 3600), "runs": runs,
            "learner_peak_mib": pool.learner_peak_bytes / 2**20,
            "fairness": fairness([pool.run_dir(r) for r in run_ids]) if together and n > 1 else 0.0}


def read_run(run_dir: Path, target: float) -> dict[str, Any]:
    evals = [e for e in rundir.read_jsonl(rundir.evals_path(run_dir)) if e.get("kind") != "base"]
    final = [e["accuracy"] for e in evals if e.get("kind") == "final"]
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    violations = 0
    for line in read_json_lines(run_dir / "learner" / "ledger.jsonl"):
        if line.get("event") == "step":
            violations += sum(not str(w).startswith((f"{run_dir.name}-", "shared-"))
                              for w in line.get("workers", {}).values())
    log = run_dir / "logs" / "learner.log"
    violations += log.read_text().count("policy_mismatch") if log.is_file() else 0
    shared = run_dir.parents[1] / "logs" / "learner-shared.log"  # the pool's shared learner names each line's run
    violations += sum(line.get("event") == "policy_mismatch" and line.get("run") == run_dir.name
                      for line in read_json_lines(shared)) if shared.is_file() else 0
    return {"reached": any(e["accuracy"] >= target for e in evals if e.get("kind") == "periodic") or
            bool(final and final[-1] >= target), "final": final[-1] if final else None,
            "steps": steps[-1]["step"] if steps else 0, "violations": violations}


def fairness(run_dirs: list[Path]) -> float:
    """Max relative error of each run's share of the samples served while every run was training."""
    lines = {d: rundir.read_jsonl(rundir.metrics_path(d)) for d in run_dirs}
    if not all(lines.values()):
        return float("nan")
    start = max(min(s["time_unix"] for s in steps) for steps in lines.values())
    end = min(max(s["time_unix"] for s in steps) for steps in lines.values())
    served = {d: sum(s["num_groups"] * group_size(d) for s in steps if start <= s["time_unix"] <= end)
              for d, steps in lines.items()}
    total = sum(served.values())
    if not total:
        return float("nan")
    n = len(run_dirs)
    return max(abs(share / total - 1 / n) * n for share in served.values())


def group_size(run_dir: Path) -> int:
    from loraflow.common.config import load_config

    return load_config(run_dir / "config.toml").run.group_size


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    counts = [int(n) for n in str(args.runs).split(",")]
    base = ensure_quick_base(0) if args.quick else ensure_demo_base(0)
    scratch = Path(harness.scratch_dir("multi-tenant-"))
    results: dict[int, dict[str, dict[str, Any]]] = {}
    for n in counts:
        results[n] = {side: run_side(scratch / f"{side}-{n}", base, args, n, side == "together")
                      for side in ("sequential", "together")}
        seq, tog = results[n]["sequential"], results[n]["together"]
        print(f"N={n}: one after another {seq['reached']}/{n} at target in {seq['wall_s']:.0f} s; all at once "
              f"{tog['reached']}/{n} in {tog['wall_s']:.0f} s; learners' peak memory {seq['learner_peak_mib']:.0f} "
              f"MiB one after another, {tog['learner_peak_mib']:.0f} MiB all at once", flush=True)
    rows, gaps, violations = [], [], 0
    for n, sides in results.items():
        seq, tog = sides["sequential"], sides["together"]
        for run_id, alone in seq["runs"].items():
            shared = tog["runs"][run_id]
            if not args.target and alone["final"] is not None and shared["final"] is not None:
                gaps.append(abs(alone["final"] - shared["final"]) * 100)
        violations += sum(r["violations"] for side in sides.values() for r in side["runs"].values())
        ratio = tog["per_hour"] / seq["per_hour"] if seq["per_hour"] else float("nan")
        rows.append([n, f"{seq['per_hour']:.1f}", f"{tog['per_hour']:.1f}", f"{ratio:.2f}", f"{seq['wall_s']:.0f}",
                     f"{tog['wall_s']:.0f}", f"{tog['fairness']:.3f}"])
    harness.table(["runs", "exp/h one after another", "exp/h all at once", "ratio", "wall seq (s)",
                   "wall together (s)", "fairness err"], rows)
    top = results[counts[-1]]
    seq_h, tog_h = top["sequential"]["per_hour"], top["together"]["per_hour"]
    harness.report("multi_tenant", "experiments_per_hour", tog_h, "experiments/h", seq_h,
                   tog_h / seq_h if seq_h else float("nan"), runs=counts[-1],
                   experiments_per_hour_ratio={n: round(s["together"]["per_hour"] / s["sequential"]["per_hour"], 3)
                                               if s["sequential"]["per_hour"] else None for n, s in results.items()},
                   accuracy_gap_points=round(max(gaps), 2) if gaps else None,
                   isolation_violations=violations, fairness=round(top["together"]["fairness"], 4),
                   target=args.target, max_steps=args.max_steps, workers_per_run=args.workers,
                   shared_workers=args.shared_workers, shared_learner=args.shared_learner,
                   learner_peak_mib={n: {side: round(s[side]["learner_peak_mib"]) for side in s}
                                     for n, s in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
