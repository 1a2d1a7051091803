"""The fault run once with real generation: an hf worker on the tiny model (the learner's own model), killed and
restarted with the broker and the learner, and the same audit as the sim runs.

With real log-probs and real adapters, the resumed learner's republished version is loaded by the worker like
any other, and the groups it trains carry the behaviour log-probs of the versions that generated them.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fault.ledger import audit_run
from tests.fault.system import System, write_config
from tests.support import Processes

pytestmark = pytest.mark.fault

NUM_PROMPTS = 48
CHECKPOINT_EVERY = 3


def test_kill_every_role_hf(procs: Processes, tmp_path: Path, tiny_model_dir: Path) -> None:
    rng = random.Random(3)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", run_dir=run_dir, model_dir=tiny_model_dir, backend="hf",
                          num_prompts=NUM_PROMPTS, checkpoint_every=CHECKPOINT_EVERY, seed=3)
    system = System(procs, config, run_dir, num_workers=1)
    system.start()
    system.run_schedule(["worker-1", "learner+", "broker"], rng, steps_between=2, checkpoint_every=CHECKPOINT_EVERY)
    system.wait_all_trained(NUM_PROMPTS, 150)
    system.stop()

    audit = audit_run(run_dir, sorted(tmp_path.glob("worker-*.log")), NUM_PROMPTS)
    print(f"kills {system.kills}: {audit.summary()}")
    assert len(audit.starts) == 2 and audit.steps_lost >= 1 and audit.withdrawn
