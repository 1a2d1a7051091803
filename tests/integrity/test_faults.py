"""Issue 14's fault injection, for real: a broker, a learner, a healthy hf worker and one faulty client, each a
process; the faulty one joins once the learner has published two versions (so the adapter differs from the
base), and from then on every group it makes is wrong. Each fault must be caught by the learner's check at
the step its first group arrives, none of its groups may be trained, the broker must quarantine it (no more
leases, its groups refused), and the run must finish its epoch with the healthy worker. A clean run with an
hf and a vLLM worker must see no mismatch at all (no false positive)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrity.run import BAD, GOOD, audit, quarantined, start_run
from tests.support import Processes, wait_for

NUM_PROMPTS = 4000  # far more than the test trains: it stops once the run went on past the quarantine
STEPS_AFTER = 3  # learner steps the run must make with the healthy worker after the quarantine


def run_with_fault(procs: Processes, tmp_path: Path, model_dir: Path, fault: str, *, backend: str = "hf"):
    run = start_run(procs, tmp_path, model_dir, num_prompts=NUM_PROMPTS)
    gate = tmp_path / "bad-may-join"
    run.start_bad(fault, model_dir, backend=backend, gate=gate)  # its imports overlap the run's start
    wait_for(lambda: run.ledger_steps() >= 2, 120, "two learner steps before the faulty client joins", procs)
    gate.touch()
    record = wait_for(lambda: quarantined(run.stats()).get(BAD), 240, f"the {fault} client to be quarantined", procs)
    target = run.ledger_steps() + STEPS_AFTER
    wait_for(lambda: run.ledger_steps() >= target, 120, "the run to go on with the healthy worker", procs)
    stats = run.stats()
    assert run.bad.alive(), run.bad.log()[-3000:]  # quarantined, not crashed: it keeps asking and is refused
    run.bad.stop()
    run.stop()
    return audit(run.run_dir, run.learner.log_path), record, stats


def check_caught(result, fault: str) -> None:
    found, record, stats = result
    assert found.trained_from.get(BAD, 0) == 0, found.summary()  # zero affected groups trained
    assert found.trained_from.get(GOOD, 0) > 0, found.summary()  # the run went on with the healthy worker
    assert found.mismatches and all(m["worker_id"] == BAD for m in found.mismatches), found.summary()
    assert found.steps_to_detect == 1, found.summary()  # caught at the step its first group reached the learner
    assert record["evidence"], record  # status shows why
    assert stats["integrity"]["policy_mismatches"], stats["integrity"]
    print(f"{fault}: {found.summary()}; quarantine record {json.dumps(record)[:400]}")


@pytest.mark.parametrize("fault", ["base_model", "swapped_files", "temperature", "fabricated"])
def test_fault_is_caught_and_the_worker_quarantined(procs: Processes, tmp_path: Path, tiny_model_dir: Path,
                                                    fault: str) -> None:
    check_caught(run_with_fault(procs, tmp_path, tiny_model_dir, fault), fault)


@pytest.mark.vllm
def test_vllm_reusing_a_lora_id_is_caught(procs: Processes, tmp_path: Path, tiny_model_dir: Path) -> None:
    check_caught(run_with_fault(procs, tmp_path, tiny_model_dir, "stale_lora_id", backend="vllm"), "stale_lora_id")


@pytest.mark.vllm
def test_clean_run_with_hf_and_vllm_workers_has_no_false_positive(procs: Processes, tmp_path: Path,
                                                                  tiny_model_dir: Path) -> None:
    run = start_run(procs, tmp_path, tiny_model_dir, num_prompts=NUM_PROMPTS)
    run.workers[2] = procs.python(run._name("vllm"), "rollout_worker", str(run.config), "--endpoint", run.endpoint,
                                  "--worker-id", "vllm-worker", "--backend", "vllm")
    wait_for(lambda: audit(run.run_dir, run.learner.log_path).trained_from.get("vllm-worker", 0) >= 8, 400,
             "8 groups of the vLLM worker trained", procs)
    stats = run.stats()
    run.stop()
    found = audit(run.run_dir, run.learner.log_path)
    assert not found.mismatches and not quarantined(stats), found.summary()
    assert found.trained_from.get("vllm-worker", 0) > 0 and found.trained_from.get(GOOD, 0) > 0, found.summary()
    assert found.checked_tokens > 0, found.summary()
    assert found.max_passing_diff < 1e-3, found.summary()  # fp32 engines agree far inside the 0.01 tolerance
    print(f"clean hf + vllm: {found.summary()}")
