"""Soak: many sim workers against one broker and one learner for minutes; memory, loss and throughput over time.

    .venv/bin/python -m bench.soak [--minutes 10] [--workers 32]

Real processes: the broker, ``--workers`` rollout workers (sim backend: 2 groups at a time, lognormal lengths of
mean 16 tokens at 100 tokens/s per stream, a coin-flip reward) and the learner (the tiny model, one thread, a
checkpoint every 20 steps). The broker's RSS and stats are sampled every ``--sample-every`` s. Figures: broker
RSS after the first window (the warm-up) and at the end, and its growth per minute over the second half (least
squares); trained groups/s per window (steady: the slowest after the first near the median); after a clean stop,
every prompt the broker issued is in the learner's committed history exactly once or still pending in the
broker's state file. Last line: value = the median rate after the first window, reference = the first window's,
ratio = the slowest later window / the median.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import harness
from loraflow.common.tiny_model import build_tiny_model
from loraflow.learner.ledger import read as read_ledger
from tests.support import Processes, start_broker, wait_for

SETUP = {"run.group_size": 4, "run.max_staleness": 2, "broker.heartbeat_interval_s": 1, "run.log_level": '"warning"',
         "integrity.check": "false"}  # sim workers make up their log-probs
WORKER = {"worker.max_new_tokens": 64, "worker.sim.tokens_per_s": 100.0, "worker.sim.mean_tokens": 16.0,
          "worker.reward": '"tests.fault.rewards:coin"'}
LEARNER = {"learner.num_threads": 1, "learner.lora_rank": 4, "learner.checkpoint_every": 20,
           "learner.save_adapter_every": 0}


def sets(settings: dict) -> list[str]:
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return 0.0
    mean_t, mean_v = statistics.fmean(t for t, _ in points), statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


def account(run_dir: Path) -> dict[str, int]:
    """Issued prompts against the learner's committed steps (in order, cut back at every start line) and the
    broker's pending keys, after a clean stop."""
    state = json.loads((run_dir / "broker" / "state.json").read_text())
    epoch, index = state["cursor"]
    assert epoch == 0, "the soak runs one endless epoch"
    chain: list[dict] = []
    for line in read_ledger(run_dir / "learner" / "ledger.jsonl"):
        chain = chain[:line["step"]] if line["event"] == "start" else chain + [line] * (line["event"] == "step")
    issued, pending = {f"0:{i}" for i in range(index)}, {f"{e}:{i}" for e, i in state["pending"]}
    done = Counter(g for step in chain for g in (*step["trained"], *step["zero_variance"]))
    return {"issued": len(issued), "trained": len(done), "trained_twice": sum(1 for n in done.values() if n > 1),
            "pending": len(pending), "lost": len(issued - set(done) - pending),
            "trained_and_pending": len(set(done) & pending), "broker_trained": state["num_trained_groups"]}


def main(argv: list[str] | None = None) -> int:
    parser = harness.flags(harness.parser(__doc__), {
        "minutes": 10.0, "workers": 32, "groups": (16, "groups per learner step"),
        "sample_every": (10.0, "seconds between samples"),
        "window_s": (60.0, "seconds of one rate window (the first is the warm-up and the reference)")})
    args = harness.parse(parser, argv, minutes=0.2, workers=2, groups=2, sample_every=1.0, window_s=4.0)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        tmp_path, procs = Path(tmp), Processes(Path(tmp))
        run_dir = tmp_path / "run"
        settings = {**SETUP, "run.groups_per_step": args.groups,
                    "model.path": f'"{build_tiny_model(tmp_path / "model", seed=0)}"'}
        try:
            broker = start_broker(procs, *(f"{k}={v}" for k, v in settings.items()), run_dir=run_dir)
            common = ["--run-dir", str(run_dir), "--endpoint", broker.endpoint, *sets(settings)]
            workers = [procs.python(f"worker-{i}", "loraflow.rollout_worker", *common, "--backend", "sim",
                                    "--capacity", "2", *sets(WORKER), "--worker-id", f"w{i}") for i in range(args.workers)]
            learner = procs.python("learner", "loraflow.learner", *common, *sets(LEARNER))
            wait_for(lambda: len(broker.stats()["workers"]) == args.workers and broker.stats()["learner"], 120,
                     "every worker and the learner to join", procs)
            samples: list[tuple[float, float, dict]] = []
            start = time.monotonic()
            end = start + args.minutes * 60
            while (now := time.monotonic()) < end:
                stats = broker.stats(timeout_s=10)
                samples.append((now - start, harness.rss_bytes(broker.proc.pid) / (1 << 20), stats))
                if len(samples) % max(1, round(args.window_s / args.sample_every)) == 0:
                    print(f"  {(now - start) / 60:4.1f} min  broker RSS {samples[-1][1]:6.1f} MB  trained "
                          f"{stats['prompts']['trained_total']:6d}  version {stats['latest_version']}", flush=True)
                time.sleep(max(0.0, min(args.sample_every, end - time.monotonic())))
            final = broker.stats(timeout_s=10)
            for proc in [learner, *workers, broker.proc]:
                code = proc.stop(timeout_s=60)
                assert code == 0, f"{proc.name} exited with {code}:\n{proc.log()[-2000:]}"
            ledger = account(run_dir)
        finally:
            procs.cleanup()
    w, rates = args.window_s, []
    for k in range(1, int(args.minutes * 60 / w) + 1):
        window = [(t, s["prompts"]["trained_total"]) for t, _, s in samples if k * w - w <= t <= k * w]
        if len(window) >= 2:
            rates.append((window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]))
    warm = [(t, rss) for t, rss, _ in samples if t >= w]
    growth = slope_per_min([p for p in warm if p[0] >= samples[-1][0] / 2])
    later = rates[1:] or rates
    median, rss_max = statistics.median(later), max(r for _, r, _ in samples)
    harness.table(["figure", "value"], [
        ["broker RSS", f"{warm[0][1]:.1f} MB after the warm-up, {samples[-1][1]:.1f} MB at the end (max {rss_max:.1f} "
                       f"MB); growth over the second half {growth:+.2f} MB/min"],
        ["trained groups/s, per window", " ".join(f"{r:.1f}" for r in rates) + f" (median after the first "
                                         f"{median:.1f}, slowest {min(later):.1f})"],
        ["prompts issued / trained / pending / lost / trained twice", " / ".join(str(ledger[k]) for k in (
            "issued", "trained", "pending", "lost", "trained_twice"))],
        ["broker counters", f"dropped {final['dropped']}, groups {final['group_events']}, rejected "
                            f"{final['rejected']}, send_failed {final['send_failed']}"]])
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["trained_and_pending"] == 0, ledger
    assert ledger["broker_trained"] == ledger["trained"], ledger
    harness.report("soak", f"trained groups/s over {args.minutes:g} min, {args.workers} sim workers", median,
                   "groups/s", rates[0], ratio=min(later) / median if median else float("nan"), minutes=args.minutes,
                   workers=args.workers, rss_mb_after_1_min=round(warm[0][1], 1), rss_mb_end=round(samples[-1][1], 1),
                   rss_mb_max=round(rss_max, 1), rss_growth_mb_per_min=round(growth, 3),
                   per_minute=[round(r, 2) for r in rates], **ledger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
