"""Issue 14's fault injection, for real: a broker, a learner, a healthy hf worker and faulty clients, each a
process; the faulty ones join once the learner has published two versions (so the adapter differs from the
base), and from then on every group they make is wrong. Each fault must be caught by the learner's check at
the step its first group arrives, none of its groups may be trained, the broker must quarantine its client (no
more leases, its groups refused), and the run must go on with the healthy worker. The four hf faults share one
run (each client has its own worker id, so each is audited on its own). The vLLM worker runs clean first (none
of its groups may fail: no false positive beside the hf worker), then its fault begins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.learner.ledger import read as read_ledger
from tests.fault.ledger import committed_chain, read_json_lines
from tests.integrity.run import GOOD, IntegrityRun, audit, quarantined, run_late_fault, start_run
from tests.support import Processes, wait_for

NUM_PROMPTS = 4000  # far more than the test trains: it stops once the run went on past the quarantine
STEPS_AFTER = 3  # learner steps the run must make with the healthy worker after the quarantine
HF_FAULTS = ("base_model", "swapped_files", "temperature", "fabricated")
VLLM = "vllm-worker"
HEALTHY_LOADS = 20  # the vLLM worker's adapter loads before it starts reusing LoRA id 1 (a few seconds)


def bad_id(fault: str) -> str:
    return f"bad-{fault}"


def run_with_faults(procs: Processes, tmp_path: Path, model_dir: Path, faults: tuple[str, ...]):
    """The faulty clients start with the run, join together after two learner steps, and must all be
    quarantined."""
    run = start_run(procs, tmp_path, model_dir, num_prompts=NUM_PROMPTS)
    gate = tmp_path / "bad-may-join"
    for fault in faults:  # their imports overlap the run's start
        run.start_bad(fault, model_dir, worker_id=bad_id(fault), gate=gate)
    wait_for(lambda: run.ledger_steps() >= 2, 120, "two learner steps before the faulty clients join", procs)
    gate.touch()
    bad_ids = sorted(run.bad)
    wait_for(lambda: set(bad_ids) <= set(quarantined(run.stats())), 240, f"{bad_ids} to be quarantined", procs)
    target = run.ledger_steps() + STEPS_AFTER
    wait_for(lambda: run.ledger_steps() >= target, 120, "the run to go on with the healthy worker", procs)
    stats = run.stats()
    for worker_id, proc in run.bad.items():  # quarantined, not crashed: each keeps asking and is refused
        assert proc.alive(), (worker_id, proc.log()[-3000:])
        proc.stop()
    return run, stats


def check_caught(run: IntegrityRun, stats: dict) -> None:
    bad_ids = frozenset(run.bad)
    found = audit(run.run_dir, run.learner.log_path, bad_ids)
    records = quarantined(stats)
    assert found.trained_from.get(GOOD, 0) > 0, found.summary()  # the run went on with the healthy worker
    assert found.mismatches and {m["worker_id"] for m in found.mismatches} == bad_ids, found.summary()
    assert found.steps_to_detect == 1, found.summary()  # caught at the step their first group reached the learner
    assert stats["integrity"]["policy_mismatches"], stats["integrity"]
    for worker_id in sorted(bad_ids):
        assert found.trained_from.get(worker_id, 0) == 0, (worker_id, found.summary())  # none of its groups trained
        assert records[worker_id]["evidence"], records[worker_id]  # status shows why
        print(f"{worker_id}: quarantine record {json.dumps(records[worker_id])[:300]}")
    print(found.summary())


def test_each_hf_fault_is_caught_and_its_client_quarantined(procs: Processes, tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    run, stats = run_with_faults(procs, tmp_path, tiny_model_dir, HF_FAULTS)
    run.stop()
    check_caught(run, stats)


def faulty_versions_from(worker_log: Path) -> int:
    """The first version a stale_lora_id worker served with another version's weights (from its log): the second
    load that reuses LoRA id 1. The first reuse finds the id no longer cached (the healthy loads after the first
    pushed it out of the resident set), so vLLM loads that version's own weights; every later one finds the id
    cached (the previous version under it is still resident) and vLLM keeps the old weights."""
    used, reuses = set(), 0
    for line in read_json_lines(worker_log):
        if line.get("event") == "adapter_loaded":
            if line["lora_id"] in used:
                reuses += 1
                if reuses == 2:
                    return line["version"]
            used.add(line["lora_id"])
    raise AssertionError(f"{worker_log} never reused a LoRA id twice")


@pytest.mark.vllm
def test_a_vllm_worker_is_clean_until_it_reuses_a_lora_id_then_caught_and_quarantined(
        procs: Processes, tmp_path: Path, tiny_model_dir: Path) -> None:
    """One vLLM worker beside the healthy hf one: its first HEALTHY_LOADS adapter loads get fresh LoRA ids (a clean
    vLLM worker: none of its groups may fail the check), then it reuses id 1 (vLLM serves the weights cached under
    it): every group from then on must fail, none be trained, and the worker be quarantined."""
    run = start_run(procs, tmp_path, tiny_model_dir, num_prompts=NUM_PROMPTS)
    run.start_bad("stale_lora_id", tiny_model_dir, worker_id=VLLM, backend="vllm", after_version=HEALTHY_LOADS)
    wait_for(lambda: VLLM in quarantined(run.stats()), 400, "the vLLM worker to be quarantined", procs)
    target = run.ledger_steps() + STEPS_AFTER
    wait_for(lambda: run.ledger_steps() >= target, 120, "the run to go on with the healthy worker", procs)
    stats = run.stats()
    assert run.bad[VLLM].alive(), run.bad[VLLM].log()[-3000:]
    run.bad[VLLM].stop()
    run.stop()

    faulty_from = faulty_versions_from(run.bad[VLLM].log_path)
    chain, _ = committed_chain(read_ledger(run.run_dir / "learner" / "ledger.jsonl"))
    trained = [(group, max(step["versions"][group])) for step in chain  # "workers" names the trained groups
               for group, worker in step["workers"].items() if worker == VLLM]
    clean = [group for group, version in trained if version < faulty_from]
    assert len(clean) >= 8 and len(clean) == len(trained), (faulty_from, trained)  # clean trained, faulty never
    found = audit(run.run_dir, run.learner.log_path, frozenset({VLLM}))
    assert found.mismatches, found.summary()
    assert all(m["worker_id"] == VLLM and m["version"] >= faulty_from for m in found.mismatches), found.mismatches
    assert quarantined(stats)[VLLM]["evidence"] and GOOD not in quarantined(stats), quarantined(stats)
    assert found.trained_from.get(GOOD, 0) > 0 and found.checked_tokens > 0, found.summary()
    assert found.max_passing_diff < 1e-3, found.summary()  # fp32 engines agree far inside the 0.01 tolerance
    print(f"vLLM worker: {len(clean)} clean groups trained, faulty from version {faulty_from}; {found.summary()}")



LATE = "late"
LATE_AUDIT_FRACTION = 0.25  # for a prompt test: the default (1/16) is measured by bench/integrity.py
LATE_MAX_STEPS = 40  # P(no audit in 40 steps at 0.25) = 1e-5, and the free path checks every step besides


def test_a_worker_that_goes_wrong_after_its_probation_is_caught_by_an_audit(procs: Processes, tmp_path: Path,
                                                                             tiny_model_dir: Path) -> None:
    """Healthy through its probation (the learner logs integrity_trusted), then it samples at temperature 0.6:
    no evidence shows that, so the free path (its tokens of the version the learner holds) or an audited step
    must fail its groups within a few steps; it is quarantined and the run goes on. The groups of it trained in
    between are the probation rule's price (common/integrity.py): counted and printed, not zero by design."""
    run = start_run(procs, tmp_path, tiny_model_dir, num_prompts=NUM_PROMPTS,
                    integrity=f"audit_fraction = {LATE_AUDIT_FRACTION}")
    late = run_late_fault(run, tiny_model_dir, LATE, after_steps=STEPS_AFTER)
    stats = run.stats()
    run.stop()
    found = audit(run.run_dir, run.learner.log_path, frozenset({LATE}))
    assert late.healthy_trained >= 16, late  # its probation: integrity.probation_groups passes in a row
    assert found.mismatches and all(m["worker_id"] == LATE and m["version"] >= late.turned_at
                                    and m["reason"] == "logprobs" for m in found.mismatches), found.mismatches
    assert late.steps_to_detect <= LATE_MAX_STEPS, (late, found.summary())
    assert GOOD not in quarantined(stats) and quarantined(stats)[LATE]["evidence"], quarantined(stats)
    assert found.trained_from.get(GOOD, 0) > 0, found.summary()
    print(f"late worker: {late}; {found.summary()}")
