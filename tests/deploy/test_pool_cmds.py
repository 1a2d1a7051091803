"""loraflow submit / runs / cancel against a pool directory, without a running pool: what they write and show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.common import pool_runs
from loraflow.common.config import ConfigError, load_config, write_resolved
from loraflow.common.pool_runs import write_state
from loraflow.deploy import pool_cmds, rundir


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "pool"
    write_resolved(load_config(None, [f"run.run_dir={directory}", "broker.pool=true"]), directory / "config.toml")
    return directory


def test_submit_writes_the_settings_under_a_free_id_and_refuses_before_writing(pool_dir: Path, tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text("[learner]\nlr = 2e-3\n")
    assert pool_cmds.submit([str(run_file), "--pool", str(pool_dir), "--set", "run.seed=4"]) == 0
    assert pool_cmds.submit([str(run_file), "--pool", str(pool_dir), "--id", "mine"]) == 0
    assert capsys.readouterr().out.split() == ["run-1", "mine"]
    settings = pool_runs.read_settings(pool_dir / "runs" / "run-1" / pool_runs.SUBMITTED)
    assert settings == {"learner": {"lr": 2e-3}, "run": {"seed": 4}}
    with pytest.raises(ConfigError, match="run mine exists in this pool already"):
        pool_cmds.submit([str(run_file), "--pool", str(pool_dir), "--id", "mine"])
    with pytest.raises(ConfigError, match="run run-2: broker is the pool's"):
        pool_cmds.submit([str(run_file), "--pool", str(pool_dir), "--set", "broker.capacity_groups=9"])
    with pytest.raises(ConfigError, match="learner.lr: must be <= 1"):
        pool_cmds.submit([str(run_file), "--pool", str(pool_dir), "--set", "learner.lr=5"])
    with pytest.raises(ConfigError, match="run id 'Bad/id'"):
        pool_cmds.submit([str(run_file), "--pool", str(pool_dir), "--id", "Bad/id"])
    assert sorted(p.name for p in (pool_dir / "runs").iterdir()) == ["mine", "run-1"]  # nothing of the refused ones
    with pytest.raises(ConfigError, match="no config.toml there"):
        pool_cmds.submit([str(run_file), "--pool", str(tmp_path / "nowhere")])


def test_runs_shows_each_runs_state_step_reward_and_accuracy(pool_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text("")
    for run_id in ("a", "b", "c"):
        pool_cmds.submit([str(run_file), "--pool", str(pool_dir), "--id", run_id])
    a, b, c = (pool_dir / "runs" / run_id for run_id in "abc")
    write_state(a, "running")
    rundir.append_jsonl(rundir.metrics_path(a), {"step": 7, "version": 7, "reward_mean": 0.5})
    rundir.append_jsonl(rundir.evals_path(a), {"version": 0, "accuracy": 0.3, "kind": "base"})
    rundir.append_jsonl(rundir.evals_path(a), {"version": 6, "accuracy": 0.625, "kind": "periodic"})
    (b / pool_runs.REFUSED).write_text("run b: model is the pool's\n")
    capsys.readouterr()
    assert pool_cmds.cancel(["c", "--pool", str(pool_dir), "--reason", "enough"]) == 0
    assert (c / pool_runs.CANCELLED).read_text() == "enough\n"
    with pytest.raises(ConfigError, match="the pool holds no run 'zz'"):
        pool_cmds.cancel(["zz", "--pool", str(pool_dir)])
    capsys.readouterr()
    assert pool_cmds.runs(["--pool", str(pool_dir)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["run", "state", "step", "version", "reward", "held-out", "reason"]
    assert table[1].split() == ["a", "running", "7", "v7", "0.500", "62.5%", "(v6)", "-"]
    assert table[2].split()[:2] == ["b", "refused"] and table[2].endswith("run b: model is the pool's")
    assert table[3].split()[:3] == ["c", "submitted", "-"]  # the pool has not seen the cancel yet
    assert pool_cmds.runs(["--pool", str(pool_dir), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["run"], r["state"], r["accuracy"]) for r in rows] == [("a", "running", 0.625), ("b", "refused", None),
                                                                    ("c", "submitted", None)]
    assert [(r["weight"], r["owner"]) for r in rows] == [(1.0, ""), (1.0, ""), (1.0, "")]


def test_runs_shows_weight_and_owner_when_a_run_has_them(pool_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text("[run]\nweight = 3\n")
    pool_cmds.submit([str(run_file), "--pool", str(pool_dir), "--id", "heavy"])
    (pool_dir / "runs" / "heavy" / pool_runs.OWNER).write_text("observer:alice\n")
    capsys.readouterr()
    assert pool_cmds.runs(["--pool", str(pool_dir)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["run", "owner", "state", "weight"]
    assert table[1].split()[:4] == ["heavy", "observer:alice", "submitted", "3.0"]
