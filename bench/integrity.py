"""Policy integrity (issue 14): is every injected fault caught, how fast, with no false alarm, at what cost.

    .venv/bin/python -m bench.integrity [--clean-minutes 10] [--no-vllm] [--faults all|none|base_model,...]
    .venv/bin/python -m bench.integrity --isolated REPEATS [--reference OTHER/learner/integrity.py]

Real processes, as tests/integrity/run.py starts them: a broker, a learner (CURVE on), a healthy hf worker and,
once the learner has published two versions, one faulty client joining fresh (so on probation,
learner/trust.py). Per fault: caught (the client quarantined and none of its groups trained), learner steps from
its first group reaching the learner to the first policy_mismatch (1 = at once), seconds to the quarantine.
Unless ``--no-late``, a worker that turns to temperature 0.6 once the learner trusts it, under the default
``integrity.audit_fraction``: the steps until it is caught and its wrong groups trained before (the probation
rule's price). Then a clean run of ``--clean-minutes`` (hf, and vLLM unless ``--no-vllm``): false positives =
policy mismatches.

Cost, from the clean run: the learner's check seconds (``integrity_s`` of each step line) as a share of its step
time and of its compute; the workers' evidence (the sha256 of each adapter load, timed here on the run's adapter
files) as a share of their run time. ``--faults none``: the clean run alone (value = cost_share, reference 0.02,
the target). ``--isolated``: the cost in one process on one policy and its batches, no run, interleaved with
another commit's check where ``--reference`` names one, and where the check's time goes (re-scoring forwards of
older versions; the free path, tokens of the version the learner holds).

Last line: value = detection rate (faults caught / injected), reference 1.0; extra keys ``false_positives``,
``max_steps_to_detect``, ``cost_share`` (the larger of the learner's step-time share and the workers'), the
learner's compute share, and per fault its figures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bench import harness
from tests.fault.ledger import read_json_lines
from tests.integrity.run import BAD, GOOD, IntegrityRun, audit, quarantined, run_late_fault, start_run
from tests.support import Processes, wait_for

NUM_PROMPTS = 100_000  # never exhausted: each scenario stops by itself
FAULTS = [("base_model", "hf"), ("swapped_files", "hf"), ("temperature", "hf"), ("fabricated", "hf"),
          ("stale_lora_id", "vllm")]
STEPS_AFTER = 5
#: groups, samples per group, prompt tokens, completion tokens: the harness's batches, the demo's, and
#: bench/gpu_smoke.sh's GPU mode (8 groups x 8 samples of 64 new tokens after a ~5-token arith prompt)
SHAPES = {"harness": (4, 4, 6, 12), "demo": (16, 8, 8, 6), "smoke": (8, 8, 5, 64)}
#: the flags and their defaults besides --no-vllm, --no-late and --set (``--quick``: the clean run alone, hf, a
#: quarter minute: the run, the checks and the cost figures)
FLAGS = {
    "clean_minutes": 10.0,
    "faults": ("all", "comma-separated faults to inject (all, or none: the clean run alone, for the cost figures)"),
    "isolated": (0, "N: instead, the check's cost in one process (no run), min of N timings"),
    "reference": ("", "with --isolated: also time this learner/integrity.py's check (another commit's, from a git "
                      "worktree) on the same policy and batches, interleaved"),
    "shapes": ("harness,demo", f"with --isolated: batch shapes, of {', '.join(SHAPES)}"),
    "model": ("builtin:tiny", "with --isolated: the policy's base model (a directory, e.g. bench/learner_memory.py "
                              "build's, or a built-in)"),
}


@contextlib.contextmanager
def integrity_run(root: Path, model_dir: Path) -> Iterator[tuple[Processes, IntegrityRun]]:
    """A started run (broker, learner, healthy worker) whose processes are cleaned up on the way out."""
    procs = Processes(root)
    try:
        yield procs, start_run(procs, root, model_dir, num_prompts=NUM_PROMPTS)
    finally:
        procs.cleanup()


def per(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def run_fault(root: Path, model_dir: Path, fault: str, backend: str) -> dict[str, Any]:
    with integrity_run(root, model_dir) as (procs, run):
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
    caught = bool(record) and found.trained_from.get(BAD, 0) == 0 and found.trained_from.get(GOOD, 0) > 0
    return {"fault": fault, "backend": backend, "caught": caught, "steps_to_detect": found.steps_to_detect,
            "seconds_to_quarantine": round(seconds, 1), "bad_groups_trained": found.trained_from.get(BAD, 0),
            "reasons": sorted({m["reason"] for m in found.mismatches})}


def run_late(root: Path, model_dir: Path) -> dict[str, Any]:
    """A worker healthy until the learner trusts it, then at temperature 0.6, under the default audit_fraction:
    what the probation rule lets through before it is caught."""
    with integrity_run(root, model_dir) as (_, run):
        late = run_late_fault(run, model_dir, BAD, after_steps=STEPS_AFTER)
        run.stop()
    return {"steps_to_detect": late.steps_to_detect, "wrong_groups_trained": late.wrong_trained,
            "healthy_groups_trained": late.healthy_trained, "seconds_to_quarantine": late.seconds_to_quarantine}


def run_clean(root: Path, model_dir: Path, minutes: float, use_vllm: bool) -> dict[str, Any]:
    from loraflow.rollout_worker.adapters import WEIGHTS_FILE, tensors_sha256

    with integrity_run(root, model_dir) as (procs, run):
        if use_vllm:
            run.workers[2] = procs.python(run._name("vllm"), "loraflow.rollout_worker", str(run.config), "--endpoint",
                                          run.endpoint, "--worker-id", "vllm-worker", "--backend", "vllm")
        started = time.monotonic()
        wait_for(lambda: time.monotonic() - started >= minutes * 60 and run.ledger_steps() >= 1, minutes * 60 + 180,
                 "the clean run (its time and one step)", procs, interval_s=1.0)
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
    num_workers = 2 if use_vllm else 1
    return {"steps": found.steps, "false_positives": len(found.mismatches), "quarantined": list(quarantined(stats)),
            "trained_from": found.trained_from, "checked_tokens": found.checked_tokens,
            "learner_step_share": per(found.integrity_s, found.wall_s),
            "learner_compute_share": per(found.integrity_s, found.compute_s),
            "worker_share": loads * hash_s / (num_workers * worker_s), "adapter_loads": loads,
            "hash_ms": round(hash_s * 1000, 3), "minutes": minutes, "max_passing_diff": found.max_passing_diff,
            "free_token_share": per(found.free_tokens, found.checked_tokens),
            "forwards_per_step": per(found.forwards, found.steps),
            "step_ms": per(1000 * found.wall_s, found.steps),
            "rescore_ms_per_step": per(1000 * (found.integrity_s - found.free_s), found.steps),
            "free_ms_per_step": per(1000 * found.free_s, found.steps),
            "compute_ms_per_step": per(1000 * found.compute_s, found.steps),
            "redone_steps": found.redone_steps, "audited_steps": found.audited_steps,
            "unaudited_token_share": per(found.unaudited_tokens, found.unaudited_tokens + found.checked_tokens)}


def honest_batch(policy: Any, rng: Any, *, versions: list[int], groups: int, group_size: int, prompt_len: int,
                 completion_len: int, sha256: dict[int, str], device: Any = "cpu") -> Any:
    """A step batch whose log-probs are the policy's own under each group's version (random tokens): what an
    honest fp32 engine would send. Group g claims ``versions[g % len(versions)]``: version 0 is the base (the
    adapter disabled: v0's B is zero), any other the parameters as they are (call it while they hold it; the
    evidence's sha256 is ``sha256.get(version, "")``)."""
    import torch

    from loraflow.common.protocol import ServedAdapter
    from loraflow.learner import data

    claimed = [versions[g % len(versions)] for g in range(groups)]
    samples, rewards = [], []
    for g, version in enumerate(claimed):
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
    served = [[ServedAdapter(version=v, adapter="a", lora_id=v, sha256=sha256.get(v, ""))] for v in claimed]
    return data.StepBatch(batch_id="bench", group_ids=[f"g{g}" for g in range(groups)], min_versions=claimed,
                          samples=samples, rewards=torch.tensor(rewards),
                          group_index=torch.tensor([s.group for s in samples]), worker_ids=["w"] * groups,
                          served=served, worker_sessions=[""] * groups)


def load_reference(path: str) -> Any:
    """Another learner/integrity.py (e.g. from a ``git worktree`` of an earlier commit) as a module of its own,
    to time its check beside this one's on the same policy and batches."""
    spec = importlib.util.spec_from_file_location("reference_integrity", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_isolated(shape: str, repeats: int, reference: str | None = None, *, model: str = "builtin:tiny",
                 settings: Sequence[str] = ()) -> dict[str, Any]:
    """The check's cost in one process, no run around it: the learner's forward/backward of one step batch (no
    optimizer step: the parameters keep the version the check knows) with and without the check, for a batch of
    the current version (the free path), of the previous one (one re-scoring forward, also timed alone) and of the
    two before the current one alternating (max_staleness 2: still one forward). Min of ``repeats`` interleaved
    timings (on a shared box the min is the least disturbed); on a GPU each ends with a synchronize. ``model``: a
    model directory or a built-in; ``settings``: config overrides (``learner.device="cuda"``, ...)."""
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
    batch = partial(honest_batch, policy, rng, groups=groups, group_size=group_size, prompt_len=prompt_len,
                    completion_len=completion_len, device=device)
    sha = {0: ""}
    batches = {}
    for version in (1, 2):  # two trained versions; the batches of older ones made while the parameters held them
        if version == 2:
            batches["previous"] = batch(versions=[1], sha256=sha)
            batches["two_older"] = batch(versions=[0, 1], sha256=sha)
        warm = batch(versions=[version - 1], sha256=sha)
        train_step(policy, optimizer, scheduler, warm, parallel=parallel, config=config, loss_config=loss_config)
        snap = publish.snapshot(policy, version=version, step=version, is_main=True)
        for c in checks:
            c.record(version, snap.sha256)
        sha[version] = snap.sha256
    batches["current"] = batch(versions=[2], sha256=sha)

    def timed(work: Callable[[], Any]) -> tuple[float, Any]:
        """(seconds, result) of ``work()``, the device synchronized on both ends."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        out = work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started, out

    def plain(step: Any) -> None:
        forward_backward(policy, step, parallel=parallel, config=config, loss_config=loss_config)
        optimizer.zero_grad(set_to_none=True)

    def checked(step: Any) -> float:
        """The checked forward/backward; returns the check's own seconds."""
        verdict = check.run(step, defer_version=check.free_version)
        assert not verdict.mismatches and verdict.num_unverifiable_tokens == 0
        watch = integrity.TrainedCheck(check, step, 2)
        forward_backward(policy, step, parallel=parallel, config=config, loss_config=loss_config,
                         observe=watch.observe)
        late = watch.finish()
        assert not late.mismatches and verdict.num_checked_tokens + late.num_checked_tokens > 0
        optimizer.zero_grad(set_to_none=True)
        return verdict.seconds + late.seconds

    previous = batches["previous"]
    pairs = check._pairs(previous, check.facts(previous, fresh=True), drawn=True,  # the rows the check re-scores
                         defer_version=check.free_version)[0]
    rows = data.collate([rescoring._restricted(previous.samples[i], v) for i, v in pairs],
                        [0.0] * len(pairs)).to(device)

    def forward_alone() -> None:
        """The re-scoring forward of those rows and nothing else (the rest of the check is bookkeeping)."""
        with check.history.scoring() as use:
            use([(0, len(pairs), 1)])
            policy.trained_logprobs(rows.input_ids, rows.select, rows.targets[rows.select], with_entropy=False)

    def reference_check(name: str) -> None:
        verdict = checks[1].run(batches[name], defer_version=2)
        assert not verdict.mismatches and verdict.num_unverifiable_tokens == 0

    names = ("current", "previous", "two_older")
    variants: dict[str, Callable[[], tuple[float, Any]]] = {}
    if reference:
        variants |= {f"reference_{n}": partial(timed, partial(reference_check, n)) for n in ("previous", "two_older")}
    variants["plain"] = partial(timed, partial(plain, batches["current"]))
    variants |= {n: partial(timed, partial(checked, batches[n])) for n in names}
    variants["forward"] = partial(timed, forward_alone)
    runs = harness.interleave(variants, repeats)
    parallel.close()
    best = {name: min(seconds for seconds, _ in r) for name, r in runs.items()}
    best |= {f"{n}_check": min(check_s for _, check_s in runs[n]) for n in names}
    timings = {"plain": "plain", "free_check": "current_check", "free_total": "current", "forward": "forward",
               "previous_check": "previous_check", "previous_total": "previous", "two_older_check": "two_older_check",
               "reference_previous": "reference_previous", "reference_two_older": "reference_two_older"}
    return {"shape": shape, "groups": groups, "group_size": group_size, "tokens": prompt_len + completion_len,
            "rows": len(pairs), **{f"{k}_ms": 1000 * best.get(v, float("nan")) for k, v in timings.items()},
            **{f"{k}_share": best[f"{v}_check"] / best["plain"]
               for k, v in (("free", "current"), ("previous", "previous"), ("two_older", "two_older"))}}


def main_isolated(repeats: int, reference: str | None, shapes: Sequence[str] = ("harness", "demo"),
                  model: str = "builtin:tiny", settings: Sequence[str] = ()) -> None:
    from loraflow.common.config import load_config

    audit_fraction = load_config(None, list(settings)).integrity.audit_fraction
    results = [run_isolated(shape, repeats, reference, model=model, settings=settings) for shape in shapes]
    for r in results:  # a batch of trusted workers' previous-version groups: re-scored on audited steps only
        r["audited_share"] = r["free_share"] + audit_fraction * (r["previous_share"] - r["free_share"])
    print(f"the check per forward+backward, min of {repeats}; trusted workers: the free path's bookkeeping every "
          f"step, the re-scoring forward on audited steps (audit_fraction {audit_fraction:g})")
    harness.table(("shape", "groups x samples, tokens", "forward+backward ms", "current version (free path)",
                   "previous version (one re-scoring forward)", "its forward alone", "two older versions (v0, v1)",
                   "trusted workers, expected", *(("reference: previous, two older",) if reference else ())),
                  [(r["shape"], f"{r['groups']} x {r['group_size']}, {r['tokens']}", f"{r['plain_ms']:.1f}",
                    f"{r['free_check_ms']:.2f} ms = {r['free_share']:.2%}",
                    f"{r['previous_check_ms']:.2f} ms = {r['previous_share']:.1%}",
                    f"{r['forward_ms']:.2f} ms, {r['rows']} rows",
                    f"{r['two_older_check_ms']:.2f} ms = {r['two_older_share']:.1%}", f"{r['audited_share']:.2%}",
                    *((f"{r['reference_previous_ms']:.2f} ms = {r['reference_previous_ms'] / r['plain_ms']:.1%}, "
                       f"{r['reference_two_older_ms']:.2f} ms = {r['reference_two_older_ms'] / r['plain_ms']:.1%}",)
                      if reference else ())) for r in results])
    figures = ("plain_ms", "free_check_ms", "previous_check_ms", "forward_ms", "two_older_check_ms", "free_share",
               "previous_share", "two_older_share", "audited_share",
               *(("reference_previous_ms", "reference_two_older_ms") if reference else ()))
    harness.report("integrity_isolated", "free_path_share", max(r["free_share"] for r in results), "share", 0.02,
                   model=model, settings=list(settings), audit_fraction=audit_fraction,
                   **{f"{r['shape']}_{k}": round(r[k], 4) for r in results for k in figures})


def main() -> None:
    parser = harness.flags(harness.parser(__doc__), FLAGS)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM fault and the vLLM clean worker")
    parser.add_argument("--no-late", action="store_true", help="skip the worker that goes wrong after its probation")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --isolated: a config "
                        "override, e.g. learner.device=\"cuda\" or learner.mixed_precision=\"bf16\" (repeatable)")
    args = harness.parse(parser, None, faults="none", no_vllm=True, no_late=True, clean_minutes=0.25)
    if args.isolated:
        shapes = [s for s in args.shapes.split(",") if s]
        if not shapes or set(shapes) - set(SHAPES):
            parser.error(f"--shapes {args.shapes!r}: choose from {list(SHAPES)}")
        main_isolated(args.isolated, args.reference or None, shapes, args.model, args.set)
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
    rounded = {name: round(clean[name], digits) for name, digits in (
        ("learner_compute_share", 4), ("worker_share", 6), ("free_token_share", 4), ("forwards_per_step", 3),
        ("step_ms", 2), ("rescore_ms_per_step", 3), ("free_ms_per_step", 4), ("unaudited_token_share", 4))}
    harness.report("integrity", metric[0], metric[1], "share", metric[2], detection_rate=detection_rate,
                   false_positives=clean["false_positives"], max_steps_to_detect=max(steps) if steps else None,
                   cost_share=round(cost_share, 4), max_passing_diff=clean["max_passing_diff"], faults=results,
                   clean_minutes=clean["minutes"], audited_steps=clean["audited_steps"], late=late, **rounded)


if __name__ == "__main__":
    main()
