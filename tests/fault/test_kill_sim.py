"""Kill every role at seeded random points of a real run (sim workers, one learner process) and audit the result.

A broker, two sim workers and a learner (the tiny model) work through one epoch of 96 prompts while the schedule
SIGKILLs a worker, the broker, the learner (once right after a step no checkpoint covers, so it must roll back),
the other worker, the learner again at a random point, and the broker again; each is restarted at once. When
every prompt is trained the run is stopped cleanly and tests/fault/ledger.py checks the invariant against the
ledger (learner ledger, worker logs, final checkpoint, broker state).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fault.ledger import audit_run
from tests.fault.system import System, write_config
from tests.support import Processes

pytestmark = pytest.mark.fault

NUM_PROMPTS = 96
CHECKPOINT_EVERY = 3


@pytest.mark.parametrize("seed", [7, 1])
def test_kill_every_role_sim(seed: int, procs: Processes, tmp_path: Path, tiny_model_dir: Path) -> None:
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", run_dir=run_dir, model_dir=tiny_model_dir, backend="sim",
                          num_prompts=NUM_PROMPTS, checkpoint_every=CHECKPOINT_EVERY, seed=seed)
    system = System(procs, config, run_dir, num_workers=2)
    system.start()
    schedule = ["worker-1", "broker", "learner+", "worker-2", "learner", "broker"]
    system.run_schedule(schedule, rng, steps_between=2, checkpoint_every=CHECKPOINT_EVERY)
    system.wait_all_trained(NUM_PROMPTS, 120)
    system.stop()

    audit = audit_run(run_dir, sorted(tmp_path.glob("worker-*.log")), NUM_PROMPTS)
    print(f"kills {system.kills}: {audit.summary()}")
    assert audit.steps_lost >= 1 and audit.withdrawn  # the rollback path was taken, and audited
    assert len(audit.starts) == 1 + schedule.count("learner") + schedule.count("learner+")
