"""Workers joining a run whose learner publishes as fast as it can: each produces an accepted group about as
soon as it could with no learner at all, keeps only a few adapter directories, and stops at once on SIGTERM.

The learner is bench/join_time.py's stand-in (``--role learner``): it publishes a new LoRA adapter of the tiny
model every time the broker has acknowledged the previous one and acks every batch at once. The joiners are real
hf workers; the bound on their join time is made of what each measured itself (start and connect, model load,
its first adapter load, its first group's generation), with slack for a machine shared by other tests.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from bench.broker_proc import RUN_TOKEN
from bench.join_time import GROUP_SIZE, join_pieces, log_events, worker_argv
from tests.support import Processes, child_env, start_broker, wait_for

pytestmark = pytest.mark.slow

NUM_JOINERS = 3
SLACK_FACTOR, SLACK_S = 1.5, 5.0  # a busy machine: every piece may take half as long again, plus a few seconds


def num_adapter_dirs(directory: Path) -> int:
    return sum(1 for p in directory.iterdir() if p.name.startswith("v")) if directory.is_dir() else 0


def test_workers_join_a_fast_publishing_run_at_once_and_stop_at_once(procs: Processes, tiny_model_dir: Path) -> None:
    broker = start_broker(procs, f'model.path="{tiny_model_dir}"', "run.max_staleness=1000",
                          f"run.group_size={GROUP_SIZE}", "run.groups_per_step=4", f'security.run_token="{RUN_TOKEN}"')
    procs.python("learner", "bench.join_time", "--role", "learner", "--endpoint", broker.endpoint,
                 "--model-dir", str(tiny_model_dir))
    wait_for(lambda: broker.stats()["latest_version"] >= 30, 60, "the learner to publish 30 versions", procs)
    version_at_join, joined_at = broker.stats()["latest_version"], time.monotonic()
    joiners, spawned = [], {}
    for i in range(NUM_JOINERS):
        name = f"joiner{i}"
        spawned[name] = time.time()
        argv = worker_argv(broker.endpoint, broker.run_dir, name, tiny_model_dir)
        joiners.append(procs.spawn(name, argv, env=child_env()))
    pieces: dict[str, dict[str, float]] = {}
    max_dirs = {j.name: 0 for j in joiners}

    def all_joined() -> bool:
        for joiner in joiners:
            adapters = broker.run_dir / "workers" / joiner.name / "adapters"
            max_dirs[joiner.name] = max(max_dirs[joiner.name], num_adapter_dirs(adapters))
            if joiner.name not in pieces and (found := join_pieces(log_events(joiner.log_path),
                                                                   spawned[joiner.name])):
                pieces[joiner.name] = found
        return len(pieces) == NUM_JOINERS

    wait_for(all_joined, 120, "every joiner's first accepted group", procs, interval_s=0.1)
    versions_per_s = (broker.stats()["latest_version"] - version_at_join) / (time.monotonic() - joined_at)
    assert versions_per_s > 5, f"the learner published only {versions_per_s:.1f} versions/s: no load to join under"
    for name, p in pieces.items():
        ideal_s = p["start_s"] + p["model_load_s"] + p["adapter_load_s"] + p["generate_s"]
        assert p["join_s"] <= SLACK_FACTOR * ideal_s + SLACK_S, (name, p)
        assert p["loads_before_first_group"] <= 3, (name, p)  # no catching up through a backlog of versions

    def num_loads(joiner: object) -> int:
        return sum(1 for e in log_events(joiner.log_path) if e["event"] == "adapter_loaded")

    # the directories stay bounded while versions keep being loaded and pruned
    wait_for(lambda: all_joined() and all(num_loads(j) >= 5 for j in joiners), 30, "5 adapter loads per joiner",
             procs, interval_s=0.1)
    assert all(n <= 3 for n in max_dirs.values()), max_dirs  # the newest loaded + one waiting (+ one being pruned)

    for joiner in joiners:  # SIGTERM while the joiner keeps loading the versions that keep coming
        stopped_at = time.monotonic()
        joiner.signal(signal.SIGTERM)
        assert joiner.wait(10) == 0, joiner.log()[-3000:]
        assert time.monotonic() - stopped_at < 2.0, (f"{joiner.name} took {time.monotonic() - stopped_at:.1f} s\n"
                                                     f"{joiner.log()[-2500:]}")
        assert log_events(joiner.log_path)[-1]["event"] == "stopped"
