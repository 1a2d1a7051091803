"""Tenants of a pool with CURVE on (broker/pool.py, deploy/pool_cmds.py), on a real pool broker process:

- ``loraflow submit RUN.toml --connect alice.toml`` goes through the broker with alice's observer key: the run is
  written into the pool with ``owner`` observer:alice, and the id comes back;
- alice watches her run (``loraflow status alice.toml --run a``) and cancels it; bob, another tenant key, can do
  neither (``forbidden``, exit 2), and cannot watch a run put in the directory on the pool's machine (no owner:
  the pool's own observer key only); the pool's own key watches every run; the pool's own run stays every key's, and
  worker and learner keys (the pool's own processes, not tenants) watch runs too;
- a run setting a pool-owned key is refused over the network with the key named (``invalid_run``), nothing
  written; so is one naming reward code outside ``broker.tenant_code`` (it would run in the pool's workers), or a
  dataset outside ``broker.tenant_data`` (the pool's processes would read it); a worker key may not submit;
  without CURVE the network control plane is refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.common import pool_runs
from loraflow.common.codes import ProtocolError
from loraflow.common.config import load_config
from loraflow.common.protocol import RunReply, RunSubmit
from loraflow.common.security import client_security, generate_keys
from loraflow.common.transport import ask, fetch_stats
from tests.support import REPO, Processes, child_env, start_broker, wait_for


def loraflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60)


def tenant_file(path: Path, endpoint: str, keys: Path, name: str) -> Path:
    path.write_text(f'[broker]\nendpoint = "{endpoint}"\n[security]\nenabled = true\nkeys_dir = "{keys}"\n'
                    f'client_key = "{name}"\n')
    return path


@pytest.fixture
def pool(procs: Processes, tmp_path: Path):
    keys = tmp_path / "keys"
    generate_keys(keys, {"worker": "worker", "observer": "observer", "alice": "observer", "bob": "observer"})
    run_dir = tmp_path / "pool"
    (tmp_path / "shared-data").mkdir()
    broker = start_broker(procs, "broker.pool=true", "security.enabled=true", f'security.keys_dir="{keys}"',
                          f'broker.tenant_data=["{tmp_path / "shared-data"}"]', run_dir=run_dir)
    return broker, keys, run_dir


def test_a_tenant_submits_watches_and_cancels_its_own_runs_only(pool, tmp_path: Path) -> None:
    broker, keys, run_dir = pool
    alice = tenant_file(tmp_path / "alice.toml", broker.endpoint, keys, "alice")
    bob = tenant_file(tmp_path / "bob.toml", broker.endpoint, keys, "bob")
    run_file = tmp_path / "run.toml"
    run_file.write_text("[run]\nseed = 3\n[learner]\nlr = 2e-3\n")

    submitted = loraflow("submit", str(run_file), "--connect", str(alice), "--id", "a")
    assert (submitted.returncode, submitted.stdout.strip()) == (0, "a"), submitted.stderr
    assert (run_dir / "runs" / "a" / pool_runs.OWNER).read_text().strip() == "observer:alice"
    assert "seed = 3" in (run_dir / "runs" / "a" / pool_runs.SUBMITTED).read_text()
    wait_for(lambda: (run_dir / "runs" / "a" / pool_runs.RESOLVED).is_file(), 30, "the broker to take run a")

    watched = loraflow("status", str(alice), "--run", "a", "--json")
    assert watched.returncode == 0, watched.stderr
    refused = loraflow("status", str(bob), "--run", "a", "--json")
    assert refused.returncode != 0 and "another tenant's" in refused.stderr + refused.stdout, refused
    cancel = loraflow("cancel", "a", "--connect", str(bob))
    assert cancel.returncode == 2 and "another tenant's" in cancel.stderr, cancel.stderr
    assert not (run_dir / "runs" / "a" / pool_runs.CANCELLED).exists()

    config = load_config(None, [f"run.run_dir={run_dir}", "broker.pool=true"])
    pool_runs.submit(config, {"run": {"seed": 4}}, "local")  # on the pool's machine: no owner
    wait_for(lambda: (run_dir / "runs" / "local" / pool_runs.RESOLVED).is_file(), 30, "the broker to take it")
    bob_key = client_security(load_config(bob), "observer")
    with pytest.raises(ProtocolError, match="another tenant's"):
        fetch_stats(broker.endpoint, security=bob_key, run="local")
    fetch_stats(broker.endpoint, security=bob_key)  # the pool's own run: every key's, as for a broker of one run
    admin = client_security(load_config(tenant_file(tmp_path / "admin.toml", broker.endpoint, keys, "observer")),
                            "observer")  # the pool's own observer key
    assert fetch_stats(broker.endpoint, security=admin, run="local")["settings"]["group_size"] >= 1
    assert fetch_stats(broker.endpoint, security=admin, run="a")

    cancel = loraflow("cancel", "a", "--connect", str(alice), "--reason", "alice is done")
    assert cancel.returncode == 0, cancel.stderr
    assert (run_dir / "runs" / "a" / pool_runs.CANCELLED).read_text().strip() == "alice is done"

    bad = loraflow("submit", str(run_file), "--connect", str(alice), "--id", "b", "--set", "model.path=elsewhere")
    assert bad.returncode == 2 and "model is the pool's" in bad.stderr, bad.stderr
    assert not (run_dir / "runs" / "b").exists()
    foreign = loraflow("submit", str(run_file), "--connect", str(alice), "--id", "b", "--set", 'worker.reward="os:system"')
    assert foreign.returncode == 2 and "broker.tenant_code" in foreign.stderr, foreign.stderr  # code runs in workers
    assert not (run_dir / "runs" / "b").exists()
    builtin = loraflow("submit", str(run_file), "--connect", str(alice), "--id", "b", "--set",
                       'worker.rewards=["loraflow:exact_match"]')
    assert builtin.returncode == 0, builtin.stderr
    data = tmp_path / "shared-data" / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 4)
    (tmp_path / "secret.jsonl").write_text('{"prompt": "the pool owner\'s", "answer": "x"}\n')
    for task, key in ((tmp_path / "secret.jsonl", "run.task"), (data.parent / ".." / "secret.jsonl", "run.task"),
                      (tmp_path / "secret.jsonl", "data.eval_path")):
        outside = loraflow("submit", str(run_file), "--connect", str(alice), "--id", "d", "--set", f'{key}="{task}"')
        assert outside.returncode == 2 and "broker.tenant_data" in outside.stderr, (key, task, outside.stderr)
        assert not (run_dir / "runs" / "d").exists()
    inside = loraflow("submit", str(run_file), "--connect", str(alice), "--id", "d", "--set", f'run.task="{data}"')
    assert inside.returncode == 0, inside.stderr
    worker_key = client_security(load_config(tenant_file(tmp_path / "w.toml", broker.endpoint, keys, "worker")),
                                 "worker")
    with pytest.raises(ProtocolError, match="a worker key may not submit"):
        ask(broker.endpoint, RunSubmit(run="c", settings="[run]\nseed = 1\n"), RunReply, what="submit",
            security=worker_key)
    assert fetch_stats(broker.endpoint, security=worker_key, run="local")  # the pool's own processes: no tenant



def test_without_curve_the_network_control_plane_is_refused(procs: Processes, tmp_path: Path) -> None:
    broker = start_broker(procs, "broker.pool=true", run_dir=tmp_path / "pool")
    with pytest.raises(ProtocolError, match="CURVE") as refused:
        ask(broker.endpoint, RunSubmit(run="a", settings="[run]\nseed = 1\n"), RunReply, what="submit")
    assert refused.value.code == "forbidden"
    assert not (tmp_path / "pool" / "runs" / "a").exists()
