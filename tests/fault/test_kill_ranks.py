"""Kill single ranks of a two-rank learner (torchrun, gloo, FSDP2) in a real run, and audit the result.

Rank 1 holds no broker connection; killing it makes torchrun's agent stop rank 0 too, so the job restarts from
its newest checkpoint like a killed rank 0 does. The schedule kills rank 1 at a random point, a worker, and
rank 0 right after a step no checkpoint covers (a rollback); the invariant is checked as in test_kill_sim.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fault.ledger import audit_run
from tests.fault.system import System, write_config
from tests.support import Processes

pytestmark = pytest.mark.fault

NUM_PROMPTS = 64
CHECKPOINT_EVERY = 3


def test_kill_learner_ranks(procs: Processes, tmp_path: Path, tiny_model_dir: Path) -> None:
    rng = random.Random(11)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", run_dir=run_dir, model_dir=tiny_model_dir, backend="sim",
                          num_prompts=NUM_PROMPTS, checkpoint_every=CHECKPOINT_EVERY, seed=11)
    system = System(procs, config, run_dir, num_workers=2, learner_ranks=2)
    system.start()
    system.run_schedule(["learner-rank-1", "worker-1", "learner+"], rng, steps_between=2,
                        checkpoint_every=CHECKPOINT_EVERY)
    system.wait_all_trained(NUM_PROMPTS, 150)
    system.stop()

    audit = audit_run(run_dir, sorted(tmp_path.glob("worker-*.log")), NUM_PROMPTS)
    print(f"kills {system.kills}: {audit.summary()}")
    assert system.kills == ["learner-rank-1", "worker-1", "learner-rank-0"]
    assert len(audit.starts) == 3 and audit.steps_lost >= 1 and audit.withdrawn
