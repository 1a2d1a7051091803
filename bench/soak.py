"""Soak: many sim workers against one broker and one learner for minutes; memory, loss and throughput over time.

    .venv/bin/python -m bench.soak [--minutes 10] [--workers 32]

Real processes: ``python -m loraflow.broker``, ``--workers`` ``python -m loraflow.rollout_worker`` with the ``sim`` backend
(lognormal completion lengths; a coin-flip reward so groups carry a learning signal) and the real learner
(``python -m loraflow.learner``, the built tiny model, one thread, a checkpoint every 20 steps). Every
``--sample-every`` seconds the broker's resident memory (``/proc/<pid>/status``) and its stats are sampled.

Figures:
- broker memory: RSS after the first minute (warm-up: buffer and adapter cache filled) and at the end, the
  highest sample, and the growth per minute over the second half (least squares). Flat = a few MB at most.
- throughput: trained groups per minute (broker stats); steady = the slowest minute after the first is close
  to the median.
- nothing lost: after a clean stop, every prompt the broker ever issued is either in the learner's committed
  history exactly once (its ledger, cut at restarts; there are none here) or still pending in the broker's state
  file; the broker's trained count equals the history's.

Last line: value = median trained groups/s per minute after the first, reference = the first minute's, ratio =
the slowest later minute / the median (1.0 = perfectly steady); extra fields carry the memory figures.
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
from bench.report import report
from loraflow.common.tiny_model import build_tiny_model
from loraflow.learner.ledger import read as read_ledger
from tests.support import Processes, start_broker, wait_for


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


def committed(ledger: list[dict]) -> list[dict]:
    """The learner's committed steps: in order, cut back at every start line (see loraflow.learner.ledger)."""
    chain: list[dict] = []
    for line in ledger:
        if line["event"] == "start":
            chain = chain[:line["step"]]
        elif line["event"] == "step":
            chain.append(line)
    return chain


def account(run_dir: Path) -> dict[str, int]:
    """Issued prompts vs the committed history and the broker's pending keys (after a clean stop)."""
    state = json.loads((run_dir / "broker" / "state.json").read_text())
    epoch, index = state["cursor"]
    assert epoch == 0, "the soak runs one endless epoch"
    issued = {f"0:{i}" for i in range(index)}
    pending = {f"{e}:{i}" for e, i in state["pending"]}
    done = Counter(g for step in committed(read_ledger(run_dir / "learner" / "ledger.jsonl"))
                   for g in (*step["trained"], *step["zero_variance"]))
    return {"issued": len(issued), "trained": len(done), "trained_twice": sum(1 for n in done.values() if n > 1),
            "pending": len(pending), "lost": len(issued - set(done) - pending),
            "trained_and_pending": len(set(done) & pending), "broker_trained": state["num_trained_groups"]}


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=2, help="groups each worker generates at once")
    parser.add_argument("--groups", type=int, default=16, help="groups per learner step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--tokens-per-s", type=float, default=100.0, help="sim decode speed per sample stream")
    parser.add_argument("--mean-tokens", type=float, default=16.0)
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--window-s", type=float, default=60.0, help="seconds of one rate window (the first is "
                        "the warm-up and the reference)")
    args = harness.parse(parser, argv, minutes=0.3, workers=2, groups=2, sample_every=1.0, window_s=6.0)

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        tmp_path = Path(tmp)
        model_dir = build_tiny_model(tmp_path / "model", seed=0)
        run_dir = tmp_path / "run"
        settings = [f"run.group_size={args.group_size}", f"run.groups_per_step={args.groups}",
                    f"run.max_staleness={args.max_staleness}", f'model.path="{model_dir}"',
                    "broker.heartbeat_interval_s=1", "run.log_level=\"warning\"",
                    "integrity.check=false"]  # sim workers make up their log-probs (learner/main.py check)
        procs = Processes(tmp_path)
        try:
            broker = start_broker(procs, *settings, run_dir=run_dir)
            common = ["--run-dir", str(run_dir), "--endpoint", broker.endpoint]
            for setting in settings:
                common += ["--set", setting]
            worker_args = ["--backend", "sim", "--capacity", str(args.capacity), "--set", "worker.max_new_tokens=64",
                           "--set", f"worker.sim.tokens_per_s={args.tokens_per_s}",
                           "--set", f"worker.sim.mean_tokens={args.mean_tokens}",
                           "--set", 'worker.reward="tests.fault.rewards:coin"']
            workers = [procs.python(f"worker-{i}", "loraflow.rollout_worker", *common, *worker_args, "--worker-id", f"w{i}")
                       for i in range(args.workers)]
            learner = procs.python("learner", "loraflow.learner", *common, "--set", "learner.num_threads=1",
                                   "--set", "learner.lora_rank=4", "--set", "learner.checkpoint_every=20",
                                   "--set", "learner.save_adapter_every=0")
            wait_for(lambda: len(broker.stats()["workers"]) == args.workers and broker.stats()["learner"], 120,
                     "every worker and the learner to join", procs)
            print(f"{args.workers} sim workers, 1 learner (tiny model), {args.minutes:g} min; sampling every "
                  f"{args.sample_every:g} s", flush=True)
            samples: list[tuple[float, float, dict]] = []
            start = time.monotonic()
            end = start + args.minutes * 60
            while (now := time.monotonic()) < end:
                stats = broker.stats(timeout_s=10)
                samples.append((now - start, harness.rss_bytes(broker.proc.pid) / (1 << 20), stats))
                if len(samples) % max(1, round(args.window_s / args.sample_every)) == 0:
                    print(f"  {(now - start) / 60:4.1f} min  broker RSS {samples[-1][1]:6.1f} MB  trained "
                          f"{stats['prompts']['trained_total']:6d}  buffered {stats['buffer']['groups']:3d}  "
                          f"version {stats['latest_version']}", flush=True)
                time.sleep(max(0.0, min(args.sample_every, end - time.monotonic())))
            final_stats = broker.stats(timeout_s=10)
            for proc in [learner, *workers, broker.proc]:
                code = proc.stop(timeout_s=60)
                assert code == 0, f"{proc.name} exited with {code}:\n{proc.log()[-2000:]}"
            ledger = account(run_dir)
        finally:
            procs.cleanup()

    per_min: list[float] = []
    w = args.window_s
    for minute in range(1, int(args.minutes * 60 / w) + 1):
        window = [(t, s["prompts"]["trained_total"]) for t, _, s in samples if minute * w - w <= t <= minute * w]
        if len(window) >= 2:
            per_min.append((window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]))
    warm = [(t, rss) for t, rss, _ in samples if t >= w]
    rss_warm, rss_end = warm[0][1], samples[-1][1]
    growth = slope_per_min([p for p in warm if p[0] >= samples[-1][0] / 2])
    later = per_min[1:] or per_min
    median = statistics.median(later)
    print(f"broker RSS: {rss_warm:.1f} MB after 1 min, {rss_end:.1f} MB at the end, max "
          f"{max(r for _, r, _ in samples):.1f} MB, growth over the second half {growth:+.2f} MB/min")
    print("trained groups/s per minute: " + " ".join(f"{r:.1f}" for r in per_min)
          + f"  (median after the first {median:.1f}, slowest {min(later):.1f})")
    print(f"accounting: {ledger}")
    print(f"broker counters: dropped {final_stats['dropped']}  groups {final_stats['group_events']}  "
          f"rejected {final_stats['rejected']}  send_failed {final_stats['send_failed']}")
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["trained_and_pending"] == 0, ledger
    assert ledger["broker_trained"] == ledger["trained"], ledger
    report("soak", f"trained groups/s over {args.minutes:g} min, {args.workers} sim workers", median, "groups/s",
           per_min[0], ratio=min(later) / median if median else float("nan"), minutes=args.minutes,
           workers=args.workers, rss_mb_after_1_min=round(rss_warm, 1), rss_mb_end=round(rss_end, 1),
           rss_mb_max=round(max(r for _, r, _ in samples), 1), rss_growth_mb_per_min=round(growth, 3),
           per_minute=[round(r, 2) for r in per_min], **{k: v for k, v in ledger.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
