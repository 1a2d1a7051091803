"""Policy integrity (issue 14): is every injected fault caught, how fast, with no false alarm, at what cost.

    .venv/bin/python -m bench.integrity [--clean-minutes 10] [--no-vllm] [--faults all|none|base_model,...]

Real processes, as tests/integrity runs them (tests/integrity/run.py): a broker, a learner (CURVE on), a healthy
hf worker and, once the learner has published two versions, one faulty client (tests/integrity/faulty_worker.py,
tests/integrity/raw_client.py). Per fault: detected (the faulty client quarantined and none of its groups
trained), steps to detection (learner steps from the first of its groups reaching the learner to the first
policy_mismatch, both counted: 1 = caught at once) and seconds from its start to the quarantine. Then a clean
run of ``--clean-minutes`` with an hf and a vLLM worker: false positives = policy mismatches (there should be
none). The faulty clients join fresh, so the learner's probation (learner/trust.py) re-scores every group of
theirs; besides them (unless ``--no-late``), a worker that is healthy until the learner logs it trusted and then
samples at temperature 0.6, under the default ``integrity.audit_fraction``: the steps it takes the free path or
an audit to catch it, and how many of its wrong groups were trained before (the probation rule's price).

Cost, from the clean run:
- learner: the check's seconds (``integrity_s`` of each step line) as a share of the learner's step time (wall
  time from the first to the last step line), and as a share of its compute (forward + backward + optimizer);
- worker: the evidence is computed once per adapter load (the sha256 of the loaded tensors); its time, measured
  here on the run's own adapter files and multiplied by the loads the workers logged, as a share of the
  workers' run time (the per-request report reads one attribute).

``--faults none`` runs the clean run alone (the cost figures; then value = cost_share, reference 0.02, the
target). ``--isolated REPEATS [--reference OTHER/learner/integrity.py]``: the cost in one process, no run; a
reference (another commit's check, from a git worktree) is timed interleaved with this one, on the same policy
and batches. Besides the shares it prints where the learner's check spends its time per step: re-scoring forwards of
older versions, and the free path (tokens of the version the learner holds, checked from the training forward).

Last line: value = detection rate (faults caught / faults injected), reference 1.0; extra keys
``false_positives``, ``max_steps_to_detect``, ``cost_share`` (the larger of the learner's step-time share and
the worker's), the learner's compute share, and per fault its figures.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import harness
from bench.report import report
from tests.fault.ledger import read_json_lines
from tests.integrity.run import BAD, GOOD, audit, quarantined, run_late_fault, start_run
from tests.support import Processes, wait_for

REPO = Path(__file__).resolve().parent.parent

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
        run.bad[BAD].stop()
        run.stop()
        found = audit(run.run_dir, run.learner.log_path)
    finally:
        procs.cleanup()
    reasons = sorted({m["reason"] for m in found.mismatches})
    caught = bool(record) and found.trained_from.get(BAD, 0) == 0 and found.trained_from.get(GOOD, 0) > 0
    return {"fault": fault, "backend": backend, "caught": caught, "steps_to_detect": found.steps_to_detect,
            "seconds_to_quarantine": round(seconds, 1), "bad_groups_trained": found.trained_from.get(BAD, 0),
            "reasons": reasons}


def run_late(root: Path, model_dir: Path) -> dict[str, Any]:
    """A worker healthy until the learner trusts it, then at temperature 0.6, under the default audit_fraction:
    what the probation rule lets through before it is caught."""
    procs = Processes(root)
    try:
        run = start_run(procs, root, model_dir, num_prompts=NUM_PROMPTS)
        late = run_late_fault(run, model_dir, BAD, after_steps=STEPS_AFTER)
        run.stop()
    finally:
        procs.cleanup()
    return {"steps_to_detect": late.steps_to_detect, "wrong_groups_trained": late.wrong_trained,
            "healthy_groups_trained": late.healthy_trained, "seconds_to_quarantine": late.seconds_to_quarantine}


def run_clean(root: Path, model_dir: Path, minutes: float, use_vllm: bool) -> dict[str, Any]:
    from loraflow.rollout_worker.adapters import WEIGHTS_FILE, tensors_sha256

    procs = Processes(root)
    try:
        run = start_run(procs, root, model_dir, num_prompts=NUM_PROMPTS)
        if use_vllm:
            run.workers[2] = procs.python(run._name("vllm"), "loraflow.rollout_worker", str(run.config), "--endpoint",
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
            "redone_steps": found.redone_steps, "audited_steps": found.audited_steps,
            "unaudited_token_share": found.unaudited_tokens / (found.unaudited_tokens + found.checked_tokens)
            if found.unaudited_tokens + found.checked_tokens else 0.0}


def honest_batch(policy: Any, rng: Any, *, versions: list[int], groups: int, group_size: int, prompt_len: int,
                 completion_len: int, sha256: dict[int, str], device: Any = "cpu") -> Any:
    """A step batch whose log-probs are the policy's own under each group's version (random tokens): what an
    honest fp32 engine would send. Group g claims ``versions[g % len(versions)]``: version 0 is the base (the
    adapter disabled: v0's B is zero), any other the parameters as they are (call it while they hold it; the
    evidence's sha256 is ``sha256.get(version, "")``)."""
    import contextlib

    import torch

    from loraflow.common.protocol import ServedAdapter
    from loraflow.learner import data

    samples, rewards = [], []
    for g in range(groups):
        version = versions[g % len(versions)]
        tokens = torch.as_tensor(rng.integers(3, policy.vocab_size, (group_size, prompt_len + completion_len)))
        select = torch.zeros(group_size, prompt_len + completion_len - 1, dtype=torch.bool)
        select[:, prompt_len - 1:] = True
        on = tokens.to(device), select.to(device)
        with torch.no_grad(), policy.reference() if version == 0 else contextlib.nullcontext():
            logp, _ = policy.trained_logprobs(on[0][:, :-1], on[1], on[0][:, 1:][on[1]], with_entropy=False)
        for k, row in enumerate(logp.cpu().reshape(group_size, completion_len)):
            samples.append(data.Sample(group=g, tokens=tokens[k], prompt_len=prompt_len, behaviour_logp=row.clone(),
                                       loss_mask=torch.ones(completion_len, dtype=torch.bool),
                                       versions=torch.full((completion_len,), version, dtype=torch.int64)))
            rewards.append(float(k % 2))
    served = [[ServedAdapter(version=versions[g % len(versions)], adapter="a", lora_id=versions[g % len(versions)],
                             sha256=sha256.get(versions[g % len(versions)], ""))] for g in range(groups)]
    return data.StepBatch(batch_id="bench", group_ids=[f"g{g}" for g in range(groups)],
                          min_versions=[versions[g % len(versions)] for g in range(groups)], samples=samples,
                          rewards=torch.tensor(rewards), group_index=torch.tensor([s.group for s in samples]),
                          worker_ids=["w"] * groups, served=served, worker_sessions=[""] * groups)


def load_reference(path: str) -> Any:
    """Another learner/integrity.py (e.g. from a ``git worktree`` of an earlier commit) as a module of its own,
    to time its check beside this one's on the same policy and batches."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reference_integrity", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_isolated(shape: str, repeats: int, reference: str | None = None, *, model: str = "builtin:tiny",
                 settings: Sequence[str] = ()) -> dict[str, Any]:
    """The check's cost in one process, without a run around it: the learner's forward/backward of one step
    batch (no optimizer step, so the parameters keep holding the version the check knows) with and without the
    check, for a batch of the current version only (the free path), one of the previous version only (one
    re-scoring forward; its forward alone timed too, the rest being bookkeeping) and one whose groups alternate
    the two versions before the current one (max_staleness 2: still one forward). Min of ``repeats``
    interleaved timings (the box is shared: the min is the least disturbed). ``model``: a model directory or a
    built-in; ``settings``: config overrides (``learner.device="cuda"``, ``learner.mixed_precision="bf16"``, ...);
    on a GPU every timing ends with a synchronize."""
    import numpy as np
    import torch

    from loraflow.common.config import load_config
    from loraflow.common.tiny_model import resolve_model
    from loraflow.learner import data, integrity, publish, rescoring
    from loraflow.learner.loss import LossConfig
    from loraflow.learner.model import build_policy
    from loraflow.learner.parallel import init_parallel
    from loraflow.learner.step import forward_backward, make_optimizer, train_step

    groups, group_size, prompt_len, completion_len = SHAPES[shape]
    torch.set_num_threads(1)
    config = load_config(None, ["learner.lora_rank=16", "learner.warmup_steps=0", "learner.lr=0.01",
                                "run.max_staleness=2", *settings])  # as the demo: the history holds v0, v1, v2
    parallel = init_parallel(config.learner.device)
    policy = build_policy(Path(resolve_model(model)), config.learner, parallel, seed=0)
    device = parallel.device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    optimizer, scheduler = make_optimizer(policy, config.learner)
    check = integrity.IntegrityCheck(config, policy, parallel)
    check.watch(optimizer)
    checks = [check]
    if reference:
        checks.append(load_reference(reference).IntegrityCheck(config, policy, parallel))
    for c in checks:
        c.record(0, "")
    loss_config = LossConfig.from_learner(config.learner)
    rng = np.random.default_rng(0)
    shape_args = {"groups": groups, "group_size": group_size, "prompt_len": prompt_len,
                  "completion_len": completion_len, "device": device}
    sha = {0: ""}
    batches = {}
    for version in (1, 2):  # two trained versions; the batches of older ones made while the parameters held them
        if version == 2:
            batches["previous"] = honest_batch(policy, rng, versions=[1], sha256=sha, **shape_args)
            batches["two_older"] = honest_batch(policy, rng, versions=[0, 1], sha256=sha, **shape_args)
        warm = honest_batch(policy, rng, versions=[version - 1], sha256=sha, **shape_args)
        train_step(policy, optimizer, scheduler, warm, parallel=parallel, config=config, loss_config=loss_config)
        snap = publish.snapshot(policy, version=version, step=version, is_main=True)
        for c in checks:
            c.record(version, snap.sha256)
        sha[version] = snap.sha256
    batches["current"] = honest_batch(policy, rng, versions=[2], sha256=sha, **shape_args)

    def plain(step: Any) -> float:
        sync()
        started = time.perf_counter()
        forward_backward(policy, step, parallel=parallel, config=config, loss_config=loss_config)
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - started

    def checked(step: Any) -> tuple[float, float]:
        sync()
        started = time.perf_counter()
        verdict = check.run(step, defer_version=check.free_version)
        assert not verdict.mismatches and verdict.num_unverifiable_tokens == 0
        watch = integrity.TrainedCheck(check, step, 2)
        forward_backward(policy, step, parallel=parallel, config=config, loss_config=loss_config,
                         observe=watch.observe)
        late = watch.finish()
        assert not late.mismatches and verdict.num_checked_tokens + late.num_checked_tokens > 0
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - started, verdict.seconds + late.seconds

    previous = batches["previous"]
    pairs = check._pairs(previous, check.facts(previous, fresh=True), drawn=True,  # the rows the check re-scores
                         defer_version=check.free_version)[0]
    rows = data.collate([rescoring._restricted(previous.samples[i], v) for i, v in pairs],
                        [0.0] * len(pairs)).to(device)

    def forward_alone() -> float:
        """The re-scoring forward of those rows and nothing else (the rest of the check is bookkeeping)."""
        sync()
        started = time.perf_counter()
        with check.history.scoring() as use:
            use([(0, len(pairs), 1)])
            policy.trained_logprobs(rows.input_ids, rows.select, rows.targets[rows.select], with_entropy=False)
        sync()
        return time.perf_counter() - started

    def reference_check(name: str) -> float:
        sync()
        started = time.perf_counter()
        verdict = checks[1].run(batches[name], defer_version=2)
        assert not verdict.mismatches and verdict.num_unverifiable_tokens == 0
        sync()
        return time.perf_counter() - started

    names = ("current", "previous", "two_older")
    times: dict[str, list[float]] = {k: [] for k in ("plain", "forward", "reference_previous", "reference_two_older",
                                                     *names, *(f"{n}_check" for n in names))}
    for _ in range(repeats):
        if reference:
            for name in ("previous", "two_older"):
                times[f"reference_{name}"].append(reference_check(name))
        times["plain"].append(plain(batches["current"]))
        for name in names:
            total, seconds = checked(batches[name])
            times[name].append(total)
            times[f"{name}_check"].append(seconds)
        times["forward"].append(forward_alone())
    best = {k: min(v) if v else float("nan") for k, v in times.items()}
    parallel.close()
    return {"shape": shape, "groups": groups, "group_size": group_size, "tokens": prompt_len + completion_len,
            "plain_ms": 1000 * best["plain"],
            "free_check_ms": 1000 * best["current_check"], "free_total_ms": 1000 * best["current"],
            "previous_check_ms": 1000 * best["previous_check"], "previous_total_ms": 1000 * best["previous"],
            "forward_ms": 1000 * best["forward"], "rows": len(pairs),
            "two_older_check_ms": 1000 * best["two_older_check"],
            "free_share": best["current_check"] / best["plain"],
            "previous_share": best["previous_check"] / best["plain"],
            "two_older_share": best["two_older_check"] / best["plain"],
            "reference_previous_ms": 1000 * best["reference_previous"],
            "reference_two_older_ms": 1000 * best["reference_two_older"]}


#: groups, samples per group, prompt tokens, completion tokens: the harness's batches, the demo's, and
#: bench/gpu_smoke.sh's GPU mode (8 groups x 8 samples of 64 new tokens after a ~5-token arith prompt)
SHAPES = {"harness": (4, 4, 6, 12), "demo": (16, 8, 8, 6), "smoke": (8, 8, 5, 64)}


def main_isolated(repeats: int, reference: str | None, shapes: Sequence[str] = ("harness", "demo"),
                  model: str = "builtin:tiny", settings: Sequence[str] = ()) -> None:
    results = [run_isolated(shape, repeats, reference, model=model, settings=settings) for shape in shapes]
    for r in results:
        print(f"{r['shape']:8s} {r['groups']} groups x {r['group_size']}, {r['tokens']} tokens: forward+backward "
              f"{r['plain_ms']:.1f} ms; current version (free path): check {r['free_check_ms']:.2f} ms = "
              f"{r['free_share']:.2%}; previous version (one re-scoring forward): check {r['previous_check_ms']:.2f} ms "
              f"= {r['previous_share']:.1%}, of which its forward of {r['rows']} rows alone {r['forward_ms']:.2f} ms; "
              f"two older versions (v0 and v1 groups): check {r['two_older_check_ms']:.2f} ms = "
              f"{r['two_older_share']:.1%} (min of {repeats})")
        if reference:
            print(f"{'':8s} reference {reference}: previous version {r['reference_previous_ms']:.2f} ms = "
                  f"{r['reference_previous_ms'] / r['plain_ms']:.1%}, two older versions "
                  f"{r['reference_two_older_ms']:.2f} ms = {r['reference_two_older_ms'] / r['plain_ms']:.1%} "
                  f"(this one: {r['previous_check_ms']:.2f} ms, {r['two_older_check_ms']:.2f} ms)")
    from loraflow.common.config import load_config

    audit_fraction = load_config(None, list(settings)).integrity.audit_fraction
    for r in results:  # a batch of trusted workers' previous-version groups: re-scored on audited steps only
        r["audited_share"] = r["free_share"] + audit_fraction * (r["previous_share"] - r["free_share"])
        print(f"{r['shape']:8s} trusted workers, audit_fraction {audit_fraction:g}: expected "
              f"{r['audited_share']:.2%} of forward+backward a step (the free path's bookkeeping every step, the "
              f"re-scoring forward on audited steps)")
    worst = max(r["free_share"] for r in results)
    report("integrity_isolated", "free_path_share", worst, "share", 0.02, model=model, settings=list(settings),
           audit_fraction=audit_fraction,
           **{f"{r['shape']}_{k}": round(r[k], 4) for r in results
              for k in ("plain_ms", "free_check_ms", "previous_check_ms", "forward_ms", "two_older_check_ms",
                        "free_share", "previous_share", "two_older_share", "audited_share")
              + (("reference_previous_ms", "reference_two_older_ms") if reference else ())})


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--clean-minutes", type=float, default=10.0)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM fault and the vLLM clean worker")
    parser.add_argument("--no-late", action="store_true", help="skip the worker that goes wrong after its "
                        "probation (run with the faults)")
    parser.add_argument("--faults", default="all", help="comma-separated faults to inject (all, or none: the "
                        "clean run alone, for the cost figures)")
    parser.add_argument("--isolated", type=int, default=0, metavar="REPEATS",
                        help="instead: the check's cost in one process (no run), min of REPEATS timings")
    parser.add_argument("--reference", metavar="INTEGRITY_PY",
                        help="with --isolated: also time this learner/integrity.py's check (another commit's, from "
                        "a git worktree) on the same policy and batches, interleaved")
    parser.add_argument("--shapes", default="harness,demo", help=f"with --isolated: batch shapes, of {list(SHAPES)}")
    parser.add_argument("--model", default="builtin:tiny", help="with --isolated: the policy's base model (a "
                        "directory, e.g. bench/learner_memory.py build's, or a built-in)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --isolated: a config "
                        "override, e.g. learner.device=\"cuda\" or learner.mixed_precision=\"bf16\" (repeatable)")
    # --quick: the clean run alone (hf, a quarter minute): the run, the checks and the cost figures
    args = harness.parse(parser, None, faults="none", no_vllm=True, no_late=True, clean_minutes=0.25)
    if args.isolated:
        shapes = [s for s in args.shapes.split(",") if s]
        if not shapes or set(shapes) - set(SHAPES):
            parser.error(f"--shapes {args.shapes!r}: choose from {list(SHAPES)}")
        main_isolated(args.isolated, args.reference, shapes, args.model, args.set)
        return
    from loraflow.common.tiny_model import resolve_model

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
        late = run_late(Path(tmp) / "late", model_dir) if faults and not args.no_late else None
        if late is not None:
            print(f"after its probation, temperature 0.6 (hf): caught {late['steps_to_detect']} learner steps after "
                  f"its first wrong group reached the learner, quarantined after {late['seconds_to_quarantine']} s; "
                  f"{late['wrong_groups_trained']} wrong groups trained before (the probation rule's price; "
                  f"{late['healthy_groups_trained']} healthy ones before the fault)", flush=True)
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
    print(f"probation and audits: {clean['audited_steps']} of {clean['steps']} steps audited; "
          f"{clean['unaudited_token_share']:.1%} of the chosen samples' tokens left unaudited (trusted workers' older "
          f"versions on the other steps)")
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
           free_ms_per_step=round(clean["free_ms_per_step"], 4), audited_steps=clean["audited_steps"], late=late,
           unaudited_token_share=round(clean["unaudited_token_share"], 4))


if __name__ == "__main__":
    main()
