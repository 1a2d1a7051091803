"""Policy integrity (issue 14): is every injected fault caught, how fast, with no false alarm, at what cost.

    .venv/bin/python bench/integrity.py [--clean-minutes 10] [--no-vllm] [--faults all|none|base_model,...]

Real processes, as tests/integrity runs them (tests/integrity/run.py): a broker, a learner (CURVE on), a healthy
hf worker and, once the learner has published two versions, one faulty client (tests/integrity/faulty_worker.py,
tests/integrity/raw_client.py). Per fault: detected (the faulty client quarantined and none of its groups
trained), steps to detection (learner steps from the first of its groups reaching the learner to the first
policy_mismatch, both counted: 1 = caught at once) and seconds from its start to the quarantine. Then a clean
run of ``--clean-minutes`` with an hf and a vLLM worker: false positives = policy mismatches (there should be
none).

Cost, from the clean run:
- learner: the check's seconds (``integrity_s`` of each step line) as a share of the learner's step time (wall
  time from the first to the last step line), and as a share of its compute (forward + backward + optimizer);
- worker: the evidence is computed once per adapter load (the sha256 of the loaded tensors); its time, measured
  here on the run's own adapter files and multiplied by the loads the workers logged, as a share of the
  workers' run time (the per-request report reads one attribute).

``--faults none`` runs the clean run alone (the cost figures; then value = cost_share, reference 0.02, the
target). Besides the shares it prints where the learner's check spends its time per step: re-scoring forwards of
older versions, and the free path (tokens of the version the learner holds, checked from the training forward).

Last line: value = detection rate (faults caught / faults injected), reference 1.0; extra keys
``false_positives``, ``max_steps_to_detect``, ``cost_share`` (the larger of the learner's step-time share and
the worker's), the learner's compute share, and per fault its figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.report import report  # noqa: E402
from tests.fault.ledger import read_json_lines  # noqa: E402
from tests.integrity.run import BAD, GOOD, audit, quarantined, start_run  # noqa: E402
from tests.support import Processes, wait_for  # noqa: E402

NUM_PROMPTS = 100_000  # never exhausted: each scenario stops by itself
FAULTS = [("base_model", "hf"), ("swapped_files", "hf"), ("temperature", "hf"), ("fabricated", "hf"),
          ("stale_lora_id", "vllm")]
STEPS_AFTER = 5


def run_fault(root: Path, model_dir: Path, fault: str, backend: str) -> dict[str, Any]:
    procs = Processes(root)
    try:
        run = start_run(procs, root, model_dir, num_prompts=NUM_PROMPTS)
        wait_for(lambda: run.ledger_steps() >= 2, 180, "two learner steps", procs)
        started = time.monotonic()
        run.start_bad(fault, model_dir, backend=backend)
        record = wait_for(lambda: quarantined(run.stats()).get(BAD), 300, f"{fault} quarantined", procs)
        seconds = time.monotonic() - started
        target = run.ledger_steps() + STEPS_AFTER
        wait_for(lambda: run.ledger_steps() >= target, 180, "the run to go on", procs)
        run.bad.stop()
        run.stop()
        found = audit(run.run_dir, run.learner.log_path)
    finally:
        procs.cleanup()
    reasons = sorted({m["reason"] for m in found.mismatches})
    caught = bool(record) and found.trained_from.get(BAD, 0) == 0 and found.trained_from.get(GOOD, 0) > 0
    return {"fault": fault, "backend": backend, "caught": caught, "steps_to_detect": found.steps_to_detect,
            "seconds_to_quarantine": round(seconds, 1), "bad_groups_trained": found.trained_from.get(BAD, 0),
            "reasons": reasons}


def run_clean(root: Path, model_dir: Path, minutes: float, use_vllm: bool) -> dict[str, Any]:
    from rollout_worker.adapters import WEIGHTS_FILE, tensors_sha256

    procs = Processes(root)
    try:
        run = start_run(procs, root, model_dir, num_prompts=NUM_PROMPTS)
        if use_vllm:
            run.workers[2] = procs.python(run._name("vllm"), "rollout_worker", str(run.config), "--endpoint",
                                          run.endpoint, "--worker-id", "vllm-worker", "--backend", "vllm")
        started = time.monotonic()
        wait_for(lambda: time.monotonic() - started >= minutes * 60, minutes * 60 + 60, "the clean run", procs,
                 interval_s=1.0)
        stats = run.stats()
        run.stop()
        worker_s = time.monotonic() - started
        found = audit(run.run_dir, run.learner.log_path)
        loads = sum(1 for proc in run.workers.values() for line in read_json_lines(proc.log_path)
                    if line.get("event") == "adapter_loaded")
        files = sorted((run.run_dir / "learner" / "adapters").glob(f"*/{WEIGHTS_FILE}"))
        sample = files[-1] if files else next(run.run_dir.glob(f"workers/*/adapters/*/{WEIGHTS_FILE}"))
        hashed = time.perf_counter()
        for _ in range(20):
            tensors_sha256(sample)
        hash_s = (time.perf_counter() - hashed) / 20
    finally:
        procs.cleanup()
    num_workers = 2 if use_vllm else 1
    return {"steps": found.steps, "false_positives": len(found.mismatches), "quarantined": list(quarantined(stats)),
            "trained_from": found.trained_from, "checked_tokens": found.checked_tokens,
            "learner_step_share": found.integrity_s / found.wall_s if found.wall_s else 0.0,
            "learner_compute_share": found.integrity_s / found.compute_s if found.compute_s else 0.0,
            "worker_share": loads * hash_s / (num_workers * worker_s), "adapter_loads": loads,
            "hash_ms": round(hash_s * 1000, 3), "minutes": minutes, "max_passing_diff": found.max_passing_diff,
            "free_token_share": found.free_tokens / found.checked_tokens if found.checked_tokens else 0.0,
            "forwards_per_step": found.forwards / found.steps if found.steps else 0.0,
            "step_ms": 1000 * found.wall_s / found.steps if found.steps else 0.0,
            "rescore_ms_per_step": 1000 * (found.integrity_s - found.free_s) / found.steps if found.steps else 0.0,
            "free_ms_per_step": 1000 * found.free_s / found.steps if found.steps else 0.0,
            "compute_ms_per_step": 1000 * found.compute_s / found.steps if found.steps else 0.0,
            "redone_steps": found.redone_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clean-minutes", type=float, default=10.0)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM fault and the vLLM clean worker")
    parser.add_argument("--faults", default="all", help="comma-separated faults to inject (all, or none: the "
                        "clean run alone, for the cost figures)")
    args = parser.parse_args()
    from common.tiny_model import resolve_model

    model_dir = resolve_model("builtin:tiny")
    chosen = {f for f, _ in FAULTS} if args.faults == "all" else set(args.faults.split(",")) - {"none", ""}
    unknown = chosen - {f for f, _ in FAULTS}
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}; choose from {[f for f, _ in FAULTS]}")
    faults = [(f, b) for f, b in FAULTS if f in chosen and not (args.no_vllm and b == "vllm")]
    results = []
    with tempfile.TemporaryDirectory(prefix="loraflow-integrity-") as tmp:
        for k, (fault, backend) in enumerate(faults):
            result = run_fault(Path(tmp) / f"fault{k}", model_dir, fault, backend)
            results.append(result)
            print(f"{fault:14s} {backend:5s} caught={result['caught']} steps_to_detect={result['steps_to_detect']} "
                  f"quarantined after {result['seconds_to_quarantine']} s, bad groups trained "
                  f"{result['bad_groups_trained']}, reasons {result['reasons']}", flush=True)
        clean = run_clean(Path(tmp) / "clean", model_dir, args.clean_minutes, not args.no_vllm)
    print(f"clean run ({clean['minutes']} min, hf{' + vllm' if not args.no_vllm else ''}): {clean['steps']} steps, "
          f"groups trained by worker {clean['trained_from']}, {clean['checked_tokens']} tokens re-scored, "
          f"false positives {clean['false_positives']}, quarantined {clean['quarantined']}; largest log-prob "
          f"difference of a passing sample {clean['max_passing_diff']:.2e} nats (fp32 tolerance 0.01)")
    print(f"cost: learner check {clean['learner_step_share']:.1%} of step time "
          f"({clean['learner_compute_share']:.1%} of its compute); worker evidence {clean['worker_share']:.3%} of "
          f"its time ({clean['adapter_loads']} loads x {clean['hash_ms']} ms)")
    print(f"where the learner's time goes, per step: {clean['step_ms']:.1f} ms of step ({clean['compute_ms_per_step']:.1f} "
          f"ms compute); re-scoring older versions {clean['rescore_ms_per_step']:.2f} ms in "
          f"{clean['forwards_per_step']:.2f} forwards; the free path {clean['free_ms_per_step']:.3f} ms for "
          f"{clean['free_token_share']:.1%} of the checked tokens; {clean['redone_steps']} steps redone")
    detection_rate = sum(r["caught"] for r in results) / len(results) if results else None
    steps = [r["steps_to_detect"] for r in results if r["steps_to_detect"] is not None]
    cost_share = max(clean["learner_step_share"], clean["worker_share"])
    metric = ("detection_rate", detection_rate, 1.0) if results else ("cost_share", cost_share, 0.02)  # the target
    report("integrity", metric[0], metric[1], "share", metric[2], detection_rate=detection_rate,
           false_positives=clean["false_positives"], max_steps_to_detect=max(steps) if steps else None,
           cost_share=round(cost_share, 4), learner_compute_share=round(clean["learner_compute_share"], 4),
           worker_share=round(clean["worker_share"], 6), max_passing_diff=clean["max_passing_diff"], faults=results,
           clean_minutes=clean["minutes"], free_token_share=round(clean["free_token_share"], 4),
           forwards_per_step=round(clean["forwards_per_step"], 3), step_ms=round(clean["step_ms"], 2),
           rescore_ms_per_step=round(clean["rescore_ms_per_step"], 3),
           free_ms_per_step=round(clean["free_ms_per_step"], 4))


if __name__ == "__main__":
    main()
