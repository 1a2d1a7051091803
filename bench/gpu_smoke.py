"""The Python half of ``bench/gpu_smoke.sh``: where each process runs, what the script waits for, and the report.

    python -m bench.gpu_smoke place --gpus N                  shell assignments for GPU mode (deploy/devices.py)
    python -m bench.gpu_smoke stats ENDPOINT OUT.json         the broker's snapshot (per-worker counters) to a file
    python -m bench.gpu_smoke report WORK --ckpt C --num-steps S --mode M --join-version V --late WORKER
                                                                 --max-staleness K [--stats OUT.json]
                                                                 per-worker table, figures and checks (exit 1)

``place`` asks :func:`loraflow.deploy.devices.plan` (the policy ``loraflow run`` uses) for one learner rank (two
from 3 GPUs) and three vLLM workers, with ``worker.vllm.gpu_memory_utilization`` sized so the k engines on one GPU
fit beside each other and the learner (0.75 / k of a GPU the learner shares, 0.85 / k of one it does not).
``report`` reads the run directory: ``learner/ledger.jsonl`` (sessions, publishes, steps with the worker of every
trained group), ``learner/metrics.jsonl`` and the workers' JSON logs (``joined`` with the version announced at
hello, ``adapter_loaded``, ``group_submitted``). The shell imports this module once a second: it imports no more
than it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

NUM_WORKERS = 3  # two from the start, one joining mid-run


# -- placement (GPU mode) ------------------------------------------------------------------------------------------

def placement(visible: tuple[str, ...]) -> tuple[Any, float, int]:
    """(Placement, gpu_memory_utilization, learner ranks) for three vLLM workers over ``visible``."""
    from loraflow.common.config import load_config
    from loraflow.deploy.devices import plan

    ranks = 2 if len(visible) >= 3 else 1

    def config(util: float) -> Any:
        return load_config(None, [f"launch.num_workers={NUM_WORKERS}", f"launch.learner_ranks={ranks}",
                                  'learner.device="cuda"', 'worker.device="cuda"', 'worker.backend="vllm"',
                                  f"worker.vllm.gpu_memory_utilization={util}"])

    first = plan(config(0.01), visible)
    per_device = Counter(d for ids in first.workers for d in ids)
    util = min((0.75 if d in first.learner else 0.85) / k for d, k in per_device.items())
    util = int(util * 100) / 100
    return plan(config(util), visible), util, ranks  # plan validates the sharing again with the chosen share


def place(args: argparse.Namespace) -> int:
    """The assignments over the GPUs this process would see: ``CUDA_VISIBLE_DEVICES``'s list (an inherited one,
    as under Slurm) or ``0 .. gpus-1``, at most ``gpus`` (what torch counts)."""
    from loraflow.deploy.devices import visible_devices

    where, util, ranks = placement(visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), args.gpus))
    workers = " ".join(",".join(ids) for ids in where.workers)
    print(f"RANKS={ranks} LEARNER_GPUS={','.join(where.learner)} WORKER_GPUS=({workers}) UTIL={util}")
    print(f"# {where.describe()}; gpu_memory_utilization {util}")
    return 0


# -- what the script waits for -------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:  # a line being written, or a library's plain-text line in a log
            continue
    return lines


def ledger(run: Path) -> list[dict[str, Any]]:
    return read_jsonl(run / "learner" / "ledger.jsonl")


def session_steps(run: Path, session: int) -> list[dict[str, Any]]:
    """The ledger's step lines written by learner life ``session`` (1-based)."""
    steps, starts = [], 0
    for line in ledger(run):
        starts += line["event"] == "start"
        if line["event"] == "step" and starts == session:
            steps.append(line)
    return steps


def newest_version(run: Path) -> int:
    return max((line["version"] for line in ledger(run) if line["event"] == "publish"), default=0)


def trained_by(run: Path, worker: str, session: int) -> int:
    """Groups of ``worker`` trained by learner life ``session``."""
    return sum(step["workers"].get(gid) == worker for step in session_steps(run, session) for gid in step["trained"])


def stats(args: argparse.Namespace) -> int:
    from loraflow.common.transport import fetch_stats

    snapshot = fetch_stats(args.endpoint, timeout_s=10.0)
    Path(args.out).write_text(json.dumps({**snapshot, "fetched_unix": time.time()}))
    return 0


# -- the report ----------------------------------------------------------------------------------------------------

def unix(line: dict[str, Any]) -> float:
    return datetime.fromisoformat(line["timestamp"]).timestamp()


def worker_rows(work: Path, committed: list[dict[str, Any]], snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per worker log: when it joined, the version at hello, its adapters, groups and tokens/s."""
    peers = {w["id"]: w for w in snapshot.get("workers", [])}
    trained = Counter(step["workers"].get(gid) for step in committed for gid in step["trained"])
    rows = []
    for path in sorted((work / "logs").glob("worker-*.log")):
        worker = path.stem.removeprefix("worker-")
        lines = [x for x in read_jsonl(path) if "event" in x]
        joined = next((x for x in lines if x["event"] == "joined"), None)
        ready = next((x for x in lines if x["event"] == "backend_ready"), {})
        loaded = [x["version"] for x in lines if x["event"] == "adapter_loaded"]
        # the adapter it served when its first lease was granted, and when that was
        first_lease = next((i for i, x in enumerate(lines) if x["event"] == "lease_granted"), None)
        served_then = [x["version"] for x in lines[:first_lease] if x["event"] == "adapter_loaded"] \
            if first_lease is not None else []
        submitted = [x for x in lines if x["event"] == "group_submitted"]
        peer = peers.get(worker, {})
        counters = peer.get("counters", {})
        # tokens over the time from its engine being ready (it says hello before loading it) to the snapshot
        tokens = counters.get("tokens_generated", 0)
        up_s = snapshot.get("fetched_unix", 0) - unix(ready) if ready else 0
        rows.append({
            "worker": worker, "backend": ready.get("backend", peer.get("backend", "?")),
            "joined_unix": unix(joined) if joined else None,
            "hello_version": joined["latest_version"] if joined else None,
            "load_s": ready.get("load_s"), "loaded": loaded,
            "first_lease_unix": unix(lines[first_lease]) if first_lease is not None else None,
            "served_at_first_lease": served_then[-1] if served_then else 0,
            "load_ms": [x["load_ms"] for x in lines if x["event"] == "adapter_loaded"],
            "submitted": len(submitted), "min_versions": [x["min_version"] for x in submitted],
            "accepted": peer.get("groups_accepted"), "trained": trained.get(worker, 0),
            "tokens": tokens, "tokens_per_s": tokens / up_s if up_s > 0 else 0.0})
    return rows


def span(versions: list[int]) -> str:
    """``[1, 2, 3, 4, 4, 5]`` as ``1..4, 4..5`` (a repeated number would show as a break)."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def report(args: argparse.Namespace) -> int:
    from bench import harness  # here, not at the top: the shell's once-a-second imports stay light

    work, ckpt = Path(args.work), args.ckpt
    run = work / "run"
    learner = run / "learner"
    lines = read_jsonl(learner / "metrics.jsonl")
    events = ledger(run)
    starts = [e for e in events if e["event"] == "start"]
    published = [e for e in events if e["event"] == "publish"]
    sessions = list(dict.fromkeys(m.get("session", "") for m in lines))
    committed = [s for s in session_steps(run, 1) if s["step"] <= ckpt] + session_steps(run, 2)
    snapshot = json.loads(Path(args.stats).read_text()) if args.stats and Path(args.stats).is_file() else {}
    rows = worker_rows(work, committed, snapshot)
    t0 = min((r["joined_unix"] for r in rows if r["joined_unix"]), default=0.0)
    withdrawn = {v for start in starts for lo, hi in start.get("withdrawn", []) for v in range(lo, hi + 1)}

    print(f"\nsteps trained: {[m['step'] for m in lines]}")
    harness.table(("step", "compute s", "tokens", "tokens/s", "publish s", "IS mean", "peak MB", "grad norm"),
                  [(m["step"], f"{m['compute_s']:.3f}", m["num_tokens"], f"{m['tokens_per_s']:.0f}",
                    f"{m['publish_s']:.3f}", f"{m['is_weight_mean']:.4f}", f"{m.get('peak_memory_mb', float('nan')):.0f}",
                    f"{m['grad_norm']:.4f}") for m in lines])
    acks = [s for m in lines for s in m.get("adapter_ack_s", {}).values()]
    print(f"adapter at the broker after publish (s): median {harness.median(acks):.3f}" if acks else "no adapter acks")
    loads = [ms for r in rows for ms in r["load_ms"]]
    print(f"worker hot-swaps (adapter_loaded load_ms): {len(loads)} loads, median {harness.median(loads):.1f} ms"
          if loads else "worker hot-swaps: no adapter_loaded line found")
    print()
    harness.table(("worker", "backend", "joined s", "engine s", "v@hello", "1st v", "tokens/s", "submitted", "accepted",
                   "trained"),
                  [(r["worker"], r["backend"], f"{r['joined_unix'] - t0:.1f}" if r["joined_unix"] else "-",
                    r["load_s"] or "-", r["hello_version"], r["loaded"][0] if r["loaded"] else "-",
                    f"{r['tokens_per_s']:.0f}", r["submitted"], r["accepted"], r["trained"]) for r in rows])
    print(f"(joined: seconds after the first worker's hello; trained: groups in the committed chain, steps "
          f"1..{ckpt} of life 1 and all of life 2; tokens/s: tokens generated over the time since its engine was ready)")

    failures = []
    life2 = [m["step"] for m in lines if m.get("session", "") == sessions[-1]]
    if len(sessions) != 2 or not life2 or life2 != list(range(ckpt + 1, ckpt + 1 + len(life2))) \
            or life2[-1] < args.num_steps:
        failures.append(f"expected two sessions, the second training steps {ckpt + 1}..{args.num_steps} or more: "
                        f"{[(m.get('session'), m['step']) for m in lines]}")
    if not all(m["grad_norm"] > 0 for m in lines):
        failures.append("a step had a zero gradient norm (random rewards should give non-zero gradients)")
    is_means = [m["is_weight_mean"] for m in lines]
    if not all(0.5 < v < 2.0 for v in is_means):
        failures.append(f"IS-weight means far from 1: {is_means}")
    if len(starts) < 2:
        failures.append("the ledger has no second session start (the resume did not happen)")
    else:
        second = starts[-1]
        ranges = second.get("withdrawn", [])
        # the checkpoint at step ckpt holds version ckpt (publish_every = 1); life 1 published ckpt + 1 too
        if not ranges or ranges[0][0] != ckpt + 1 or ranges[-1][1] < ckpt + 1:
            failures.append(f"resume withdrew {ranges}, expected a range starting at version {ckpt + 1}")
        if second.get("next_version", 0) <= ckpt + 1:
            failures.append(f"resume numbers the republished weights {second.get('next_version')}, not after "
                            f"{ckpt + 1}")
        republished = [e for e in published if e["version"] == second.get("next_version")]
        if not republished or republished[0]["step"] != ckpt:
            failures.append(f"version {second.get('next_version')} should republish the checkpoint's weights "
                            f"(step {ckpt}): {republished}")
        print(f"withdrawn {ranges}; checkpoint weights republished as version {second.get('next_version')}; "
              f"published versions {span([e['version'] for e in published])}")
    if len(rows) != NUM_WORKERS or any(r["joined_unix"] is None for r in rows):
        failures.append(f"expected {NUM_WORKERS} workers that joined: {[(r['worker'], r['joined_unix']) for r in rows]}")
    for r in rows:
        if r["trained"] < 1:
            failures.append(f"worker {r['worker']} contributed no trained group")
    late = next((r for r in rows if r["worker"] == args.late), None)
    if late is None or late["joined_unix"] is None:
        failures.append(f"the mid-run worker {args.late} never joined")
    else:
        first = late["loaded"][0] if late["loaded"] else None
        # the version current when it was started (args.join_version) or a newer one, never a withdrawn one,
        # loaded before it generated: no group of it has a token older than that version
        if late["hello_version"] is None or late["hello_version"] < args.join_version \
                or late["hello_version"] in withdrawn:
            failures.append(f"{args.late} was told version {late['hello_version']} at hello; the current one when it "
                            f"started was {args.join_version} (withdrawn: {sorted(withdrawn)})")
        if first is None or first < late["hello_version"] or first in withdrawn:
            failures.append(f"{args.late}'s first adapter was {first}, not the version at hello "
                            f"({late['hello_version']}) or newer")
        lease_at = late["first_lease_unix"]
        if lease_at is not None:
            # the broker leases only to a worker within max_staleness of its newest version; the ledger's newest
            # may be one ahead of the broker's (written before the adapter is sent)
            newest = max((e["version"] for e in published if e["time_unix"] <= lease_at), default=0)
            if late["served_at_first_lease"] < newest - args.max_staleness - 1:
                failures.append(f"{args.late} served version {late['served_at_first_lease']} at its first lease, "
                                f"when {newest} was published (run.max_staleness = {args.max_staleness})")
            print(f"{args.late}: first lease served by version {late['served_at_first_lease']}, newest published "
                  f"then {newest}")
        if any(v < args.join_version for v in late["min_versions"]):
            failures.append(f"{args.late} submitted groups with tokens older than the version current at its start "
                            f"({args.join_version}): min versions {span(sorted(set(late['min_versions'])))}")
        print(f"{args.late} started when version {args.join_version} was current; told {late['hello_version']} at "
              f"hello, first adapter loaded {first}, {late['trained']} groups trained")
    adapters = sorted(p.name for p in (learner / "adapters").iterdir()) if (learner / "adapters").is_dir() else []
    print(f"adapter directories: {len(adapters)} ({adapters[0]}..{adapters[-1]})" if adapters else
          "adapter directories: none")
    harness.report("gpu_smoke", "checks_failed", len(failures), "checks", 0, ratio=0.0 if failures else 1.0,
                   mode=args.mode, workers={r["worker"]: {k: r[k] for k in ("backend", "hello_version", "tokens_per_s",
                                                                           "submitted", "trained")} for r in rows})
    if failures:
        print("SMOKE FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"SMOKE OK ({args.mode} mode)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("place").add_argument("--gpus", type=int, default=1, help="the GPUs torch counts")
    p = sub.add_parser("stats")
    p.add_argument("endpoint")
    p.add_argument("out")
    p = sub.add_parser("report")
    p.add_argument("work")
    for name in ("--ckpt", "--num-steps", "--join-version", "--max-staleness"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--late", required=True)
    p.add_argument("--stats", default="")
    args = parser.parse_args(argv)
    return {"place": place, "stats": stats, "report": report}[args.command](args)

if __name__ == "__main__":
    sys.exit(main())
