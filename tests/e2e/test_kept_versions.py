"""A real run (broker, one hf worker, the learner on the tiny model, the policy check re-scoring every group) with
``worker.keep_version_within = 1``: turns under way keep the version they run under while it is one behind the
newest, so the worker holds two adapter versions at once, and the learner's exact re-scoring of every token under
the version it records (``integrity.audit_fraction = 1``: no sampling) finds no mismatch (issue 13).
"""

from __future__ import annotations

from pathlib import Path

from tests.fault.ledger import read_json_lines
from tests.fault.system import System, write_config
from tests.integrity.run import audit
from tests.support import Processes, wait_for

STEPS = 12


def resident_versions(log_path: Path) -> list[list[int]]:
    """The versions the worker held after each adapter load (its ``adapter_loaded`` lines)."""
    return [line["resident"] for line in read_json_lines(log_path) if line.get("event") == "adapter_loaded"]


def test_turns_keep_their_version_and_every_token_still_matches_it(procs: Processes, tmp_path: Path,
                                                                   tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", run_dir=run_dir, model_dir=tiny_model_dir, backend="hf",
                          num_prompts=400, max_staleness=2, checkpoint_every=0, extra="audit_fraction = 1.0\n")
    text = config.read_text()
    assert "max_new_tokens = 8\n" in text
    config.write_text(text.replace("max_new_tokens = 8\n", 'max_new_tokens = 48\npartial_policy = "continue"\n'
                                   "keep_version_within = 1\n"))
    system = System(procs, config, run_dir, num_workers=1)
    system.start()
    worker_log = system.workers[1].log_path

    def kept_and_trained() -> bool:
        return (any(len(held) > 1 for held in resident_versions(worker_log))
                and system.ledger_steps() >= STEPS)

    wait_for(kept_and_trained, 240, f"a load that kept an older version, and {STEPS} steps", procs, interval_s=0.5)
    system.stop()
    held = [versions for versions in resident_versions(worker_log) if len(versions) > 1]
    assert all(len(versions) == 2 and versions[1] - versions[0] == 1 for versions in held), held
    found = audit(run_dir, system.learner.log_path, bad_ids=frozenset())
    assert found.steps >= STEPS and found.checked_tokens > 0, found.summary()
    assert found.mismatches == [] and found.first_mismatch_step is None, found.summary()
