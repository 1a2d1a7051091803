"""CURVE as an operator meets it, on a real broker process: the documented key commands work end to end, and
every way of getting the keys wrong fails fast with the cause, is named in the broker's log and counted.

- ``loraflow keys DIR --worker gpu-1 --learner trainer`` (deploy/README.md) makes an observer pair too, and
  ``loraflow keys DIR`` on a directory without one (an older release's) adds it and keeps the rest, so the
  documented ``loraflow status run.toml --endpoint ...`` works and shows that encryption is on;
- a key the broker does not authorise (one made in its keys dir whose authorisation was removed, one from
  another directory), a wrong broker public key, and a client without CURVE: a worker (and a learner) exits 1
  well within ``run.connect_timeout_s`` with the cause in one log line (no traceback, no double-close error); the
  broker logs the refused key by its file when it has it and counts each cause in ``auth{...}``;
- start order: a worker started before the broker joins once the broker comes up within the wait, and with no
  broker at all it gives up after ``run.connect_timeout_s`` naming that setting.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraflow.common.security import ClientSecurity, generate_keys
from loraflow.common.transport import fetch_stats
from tests.fault.system import write_config
from tests.support import REPO, BrokerHandle, Processes, child_env, start_broker, wait_for

CONNECT_TIMEOUT_S = 60  # the configured wait in the failure cases: each must fail well before it (a busy machine
# can take seconds to start four workers; an unrecognised failure would wait all of it)


def loraflow(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout_s)


def documented_keys(keys: Path) -> None:
    """The command of deploy/README.md's multi-machine section."""
    done = loraflow("keys", str(keys), "--worker", "gpu-1", "--worker", "gpu-2", "--learner", "trainer")
    assert done.returncode == 0, done.stderr
    assert (keys / "observer.key_secret").is_file() and (keys / "authorized" / "observer" / "observer.key").is_file()


@pytest.fixture
def curve_run(procs: Processes, tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, Path, BrokerHandle]:
    """(config, keys dir, broker) of a run with security on, keys made as the docs say."""
    keys = tmp_path / "keys"
    documented_keys(keys)
    config = write_config(tmp_path / "run.toml", run_dir=tmp_path / "run", model_dir=tiny_model_dir, backend="sim",
                          num_prompts=64, extra=f'[security]\nenabled = true\nkeys_dir = "{keys}"\n')
    return config, keys, start_broker(procs, config=config)


def test_keys_on_an_existing_dir_add_the_observer_and_keep_the_rest(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    documented_keys(keys)
    for path in (keys / "observer.key", keys / "observer.key_secret", keys / "authorized/observer/observer.key"):
        path.unlink()  # a directory made before every keys dir had an observer pair
    worker_secret = (keys / "gpu-1.key_secret").read_bytes()
    done = loraflow("keys", str(keys))
    assert done.returncode == 0, done.stderr
    assert "made       observer key 'observer'" in done.stdout, done.stdout
    assert "kept       broker key 'broker'" in done.stdout
    assert "the broker accepts: worker gpu-1, gpu-2; learner trainer; observer observer" in done.stdout
    assert (keys / "gpu-1.key_secret").read_bytes() == worker_secret  # nothing existing is remade
    ClientSecurity.load(keys, "observer")

    again = loraflow("keys", str(keys), "--worker", "gpu-1")
    assert again.returncode == 0 and "made" not in again.stdout and "kept       worker key 'gpu-1'" in again.stdout
    assert "kept       observer key 'observer'" in again.stdout

    (keys / "observer.key_secret").unlink()  # the secret lost, its authorisation left: a new pair replaces both
    old_public = (keys / "authorized" / "observer" / "observer.key").read_bytes()
    remade = loraflow("keys", str(keys))
    assert remade.returncode == 0 and "made       observer key 'observer'" in remade.stdout, remade.stdout
    assert (keys / "authorized" / "observer" / "observer.key").read_bytes() != old_public
    ClientSecurity.load(keys, "observer")

    client_copy = tmp_path / "client"  # what a client machine holds: never a place for a new broker pair
    client_copy.mkdir()
    shutil.copy(keys / "broker.key", client_copy)
    refused = loraflow("keys", str(client_copy))
    assert refused.returncode == 2 and "it is a client's copy" in refused.stderr, refused.stderr
    assert not (client_copy / "broker.key_secret").exists()


def test_status_works_with_the_documented_commands_and_shows_encryption(curve_run, tmp_path: Path) -> None:
    config, keys, broker = curve_run
    done = loraflow("status", str(config), "--endpoint", broker.endpoint)
    assert done.returncode == 0, done.stderr
    assert "security  encryption on (CURVE, authorised keys only)" in done.stdout, done.stdout

    plain = loraflow("status", str(config), "--endpoint", broker.endpoint, "--set", "security.enabled=false")
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert "requires CURVE" in plain.stderr, plain.stderr  # a mismatch, or handshakes dropped: both say it

    bare = tmp_path / "bare"  # a client machine given only broker.key: the observer pair is missing
    bare.mkdir()
    shutil.copy(keys / "broker.key", bare)
    missing = loraflow("status", str(config), "--endpoint", broker.endpoint,
                       "--set", f'security.keys_dir="{bare}"')
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert f"{bare}/observer.key_secret is missing" in missing.stderr and "security.keys_dir" in missing.stderr
    assert f"`loraflow keys {bare}`" in missing.stderr


def test_wrong_keys_fail_fast_with_the_cause_and_are_counted(curve_run, procs: Processes, tmp_path: Path) -> None:
    config, keys, broker = curve_run
    (keys / "authorized" / "worker" / "gpu-2.key").unlink()  # gpu-2's authorisation removed
    elsewhere = tmp_path / "elsewhere"  # a pair from another `loraflow keys` directory, with our broker.key
    generate_keys(elsewhere, {"mallory": "worker"})
    (elsewhere / "broker.key_secret").unlink()
    shutil.copy(keys / "broker.key", elsewhere)
    wrong_broker = tmp_path / "wrong-broker"  # gpu-1's own pair, but another broker's public key
    wrong_broker.mkdir()
    for name in ("gpu-1.key", "gpu-1.key_secret"):
        shutil.copy(keys / name, wrong_broker)
    shutil.copy(elsewhere / "mallory.key", wrong_broker / "broker.key")
    cases = {
        "removed": (['security.client_key="gpu-2"'], "the broker refused this client's key"),
        "stranger": ([f'security.keys_dir="{elsewhere}"', 'security.client_key="mallory"'],
                     "the broker refused this client's key"),
        "wrong_broker_key": ([f'security.keys_dir="{wrong_broker}"', 'security.client_key="gpu-1"'],
                             "is not this broker's"),
        "plaintext": (["security.enabled=false"], "requires CURVE (security.enabled = true there)"),
    }
    cases["learner"] = (['security.client_key="gpu-2"'], "the broker refused this client's key")  # the learner too
    started = time.monotonic()
    clients = {}
    for name, (overrides, _) in cases.items():
        args = [str(config), "--endpoint", broker.endpoint, "--set", f"run.connect_timeout_s={CONNECT_TIMEOUT_S}"]
        for override in overrides:
            args += ["--set", override]
        clients[name] = (procs.python(name, "loraflow.learner", *args) if name == "learner" else
                         procs.python(name, "loraflow.rollout_worker", *args, "--worker-id", name))
    for name, (_, cause) in cases.items():
        client = clients[name]
        code = client.wait(CONNECT_TIMEOUT_S + 30)
        log = client.log()
        assert code == 1, (name, code, log)
        assert cause in log and "broker_unavailable" in log, (name, log)
        assert "Traceback" not in log and "non-socket" not in log, (name, log)
    assert time.monotonic() - started < CONNECT_TIMEOUT_S, "a wrong key waited for the connect timeout"

    observer = ClientSecurity.load(keys, "observer")
    # a plaintext client shows as a mechanism mismatch, or as a dropped handshake when it noticed first
    auth = wait_for(lambda: (a := fetch_stats(broker.endpoint, security=observer)["auth"]).get("refused", 0) >= 3
                    and a.get("wrong_server_key", 0) >= 1 and a.get("plaintext", 0) + a.get("dropped", 0) >= 1 and a,
                    10, "every failed handshake to be counted", procs)
    assert auth["refused"] == 3 and set(auth) <= {"refused", "wrong_server_key", "plaintext", "dropped"}, auth
    events = [json.loads(line) for line in broker.proc.log().splitlines() if line.startswith("{")]
    refused = [e for e in events if e["event"] == "auth_refused"]
    assert [e.get("key_file") for e in refused].count(str(keys / "gpu-2.key")) == 2, refused  # named by its file
    assert len(refused) == 3 and any("another `loraflow keys` directory" in e["why"] for e in refused), refused
    causes = {e["cause"] for e in events if e["event"] == "handshake_failed"}
    assert "wrong_server_key" in causes and causes & {"plaintext", "dropped"}, causes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_worker_started_before_the_broker_joins_within_the_wait(procs: Processes, tmp_path: Path,
                                                                  tiny_model_dir: Path) -> None:
    keys = tmp_path / "keys"
    documented_keys(keys)
    config = write_config(tmp_path / "run.toml", run_dir=tmp_path / "run", model_dir=tiny_model_dir, backend="sim",
                          num_prompts=64, extra=f'[security]\nenabled = true\nkeys_dir = "{keys}"\n')
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = procs.python("worker", "loraflow.rollout_worker", str(config), "--endpoint", endpoint, "--worker-id", "early",
                          "--set", 'security.client_key="gpu-1"', "--set", "run.connect_timeout_s=60")
    time.sleep(3)  # the scenario, not a synchronisation: the broker comes up a while after its worker
    assert worker.alive(), worker.log()
    broker = start_broker(procs, f'broker.bind="{endpoint}"', config=config)
    assert broker.endpoint == endpoint
    observer = ClientSecurity.load(keys, "observer")
    wait_for(lambda: [w["id"] for w in fetch_stats(endpoint, security=observer)["workers"]] == ["early"], 30,
             "the early worker to join", procs)
    assert worker.stop() == 0, worker.log()


def test_no_broker_at_all_ends_after_the_connect_timeout_naming_it(procs: Processes, tmp_path: Path,
                                                                   tiny_model_dir: Path) -> None:
    config = write_config(tmp_path / "run.toml", run_dir=tmp_path / "run", model_dir=tiny_model_dir, backend="sim",
                          num_prompts=64)
    started = time.monotonic()
    worker = procs.python("worker", "loraflow.rollout_worker", str(config), "--endpoint", f"tcp://127.0.0.1:{free_port()}",
                          "--set", "run.connect_timeout_s=2")
    assert worker.wait(60) == 1
    assert time.monotonic() - started >= 2
    log = worker.log()
    assert "within 2 s (run.connect_timeout_s)" in log and "Traceback" not in log, log


def test_missing_key_files_are_one_line_naming_file_setting_and_command(tmp_path: Path, tiny_model_dir: Path) -> None:
    keys = tmp_path / "keys"
    documented_keys(keys)
    config = write_config(tmp_path / "run.toml", run_dir=tmp_path / "run", model_dir=tiny_model_dir, backend="sim",
                          num_prompts=64, extra=f'[security]\nenabled = true\nkeys_dir = "{keys}"\n')
    (keys / "broker.key_secret").rename(tmp_path / "broker.key_secret")  # the broker's pair, gone
    cases = {  # role: (extra args, the file, the command that makes it)
        "worker": (["--set", 'security.client_key="gpu-3"'], keys / "gpu-3.key_secret",
                   f"`loraflow keys {keys} --worker gpu-3`"),
        "learner": ([], keys / "learner.key_secret", f"`loraflow keys {keys} --learner learner`"),
        "broker": ([], keys / "broker.key_secret", f"`loraflow keys {keys}`"),
    }
    for role, (args, path, command) in cases.items():
        done = loraflow(role, str(config), *args)
        assert done.returncode == 2, (role, done.returncode, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, (role, done.stderr)
        assert f"{path} is missing" in lines[0] and "security.keys_dir" in lines[0] and command in lines[0], lines
