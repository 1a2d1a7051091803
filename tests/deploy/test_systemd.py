"""The systemd units and the scripts they call: units verify, every variable is documented, and the scripts
start real roles (a broker, a sim worker, a learner) that find each other."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.common.transport import fetch_stats
from tests.support import REPO, Processes, child_env, wait_for

SYSTEMD = REPO / "deploy" / "systemd"
SCRIPTS = REPO / "deploy" / "scripts"
UNITS = ["loraflow-broker.service", "loraflow-worker@.service", "loraflow-learner.service", "loraflow.target"]
VENV = Path(sys.executable).parent.parent


def parse_unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(path.read_text())
    return parser


@pytest.mark.parametrize("name", UNITS)
def test_unit_structure(name: str) -> None:
    unit = parse_unit(SYSTEMD / name)
    assert unit["Unit"]["Description"]
    if name.endswith(".target"):
        assert set(unit["Unit"]["Wants"].split()) == {"loraflow-broker.service", "loraflow-learner.service"}
        return
    service = unit["Service"]
    assert service["EnvironmentFile"] == "/etc/loraflow/loraflow.env"
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] in ("on-failure", "always")
    assert "2" in service["RestartPreventExitStatus"].split()  # a config error (loraflow.common.cli) is never restarted
    command = service["ExecStart"].split()
    script = SCRIPTS / Path(command[0]).name
    assert command[0] == f"/opt/loraflow/deploy/scripts/{script.name}"
    assert script.is_file() and os.access(script, os.X_OK)
    assert unit["Install"]["WantedBy"] == "loraflow.target"
    if name == "loraflow-worker@.service":
        assert command[1:] == ["%i"]  # the instance number becomes part of the worker id
    if name == "loraflow-learner.service":
        assert service["KillMode"] == "control-group"  # SIGTERM reaches every torchrun rank


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """Installed paths replaced by this checkout's, so that verify can check that ExecStart is executable."""
    for name in UNITS:
        (tmp_path / name).write_text((SYSTEMD / name).read_text().replace("/opt/loraflow", str(REPO)))
    shutil.copy(tmp_path / "loraflow-worker@.service", tmp_path / "loraflow-worker@3.service")
    names = [n for n in UNITS if "@." not in n] + ["loraflow-worker@3.service", "loraflow-worker@.service"]
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(tmp_path / n) for n in names)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not re.search(r"Unknown (key|section)|not executable|bad unit file", result.stderr), result.stderr


def test_env_file_documents_every_variable_the_scripts_read() -> None:
    documented = set(re.findall(r"^(LORAFLOW_[A-Z_]+)=", (SYSTEMD / "loraflow.env").read_text(), re.M))
    used = set()
    for script in SCRIPTS.glob("*.sh"):
        used |= set(re.findall(r"\$\{?(LORAFLOW_[A-Z_]+)", script.read_text()))
    internal = {"LORAFLOW_PYTHON", "LORAFLOW_ARGS", "LORAFLOW_DRY_RUN"}
    assert used - internal <= documented, sorted(used - internal - documented)


def script_env(tmp_path: Path, config: Path, **extra: str) -> dict[str, str]:
    env = child_env(LORAFLOW_HOME=str(REPO), LORAFLOW_VENV=str(VENV), LORAFLOW_CONFIG=str(config),
                    LORAFLOW_RUN_DIR=str(tmp_path / "run"), **extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def dry_run(tmp_path: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.toml"
    config.touch()
    return subprocess.run([str(SCRIPTS / script), *args], env=script_env(tmp_path, config, LORAFLOW_DRY_RUN="1", **env),
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("script", ["broker.sh", "worker.sh", "learner.sh"])
def test_scripts_explain_themselves(script: str) -> None:
    result = subprocess.run([str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "LORAFLOW_" in result.stdout and "SIGTERM" in result.stdout


def test_learner_script_chooses_plain_torchrun_or_multinode(tmp_path: Path) -> None:
    single = dry_run(tmp_path, "learner.sh", LORAFLOW_ENDPOINT="tcp://b:5555")
    assert single.returncode == 0 and " -m loraflow.learner " in single.stdout and "torch.distributed.run" not in single.stdout
    local = dry_run(tmp_path, "learner.sh", LORAFLOW_LEARNER_NPROC="2")
    assert "torch.distributed.run --standalone --local-addr=127.0.0.1 --nproc_per_node=2 -m loraflow.learner" in local.stdout
    missing = dry_run(tmp_path, "learner.sh", LORAFLOW_LEARNER_NNODES="2")
    assert missing.returncode == 2 and "LORAFLOW_RDZV_ENDPOINT" in missing.stderr
    multi = dry_run(tmp_path, "learner.sh", LORAFLOW_LEARNER_NNODES="2", LORAFLOW_LEARNER_NODE_RANK="1",
                    LORAFLOW_RDZV_ENDPOINT="learner-0:29500", LORAFLOW_LEARNER_NPROC="8")
    assert ("--nnodes=2 --nproc_per_node=8 --node_rank=1 --rdzv_backend=c10d --rdzv_endpoint=learner-0:29500"
            in multi.stdout)


def test_worker_script_names_the_worker_after_host_and_instance(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    result = dry_run(tmp_path, "worker.sh", "7", LORAFLOW_ENDPOINT="tcp://b:5555", LORAFLOW_KEYS_DIR=str(keys))
    assert result.returncode == 0
    assert f"--worker-id {socket.gethostname().split('.')[0]}-7" in result.stdout
    assert "--endpoint tcp://b:5555" in result.stdout and "security.enabled=true" in result.stdout
    assert "security.client_key=\\\"worker\\\"" in result.stdout
    assert dry_run(tmp_path, "worker.sh").returncode == 2  # the instance is required
    assert dry_run(tmp_path, "worker.sh", "x").returncode == 2  # and a number


def test_gpus_are_spread_over_worker_instances(tmp_path: Path) -> None:
    gpus = {"LORAFLOW_WORKER_GPUS": "4,5", "LORAFLOW_LEARNER_GPUS": "0,1,2,3"}
    for instance, gpu in (("1", "4"), ("2", "5"), ("3", "4")):
        assert dry_run(tmp_path, "worker.sh", instance, **gpus).stdout.startswith(f"CUDA_VISIBLE_DEVICES={gpu} ")
    learner = dry_run(tmp_path, "learner.sh", LORAFLOW_LEARNER_NPROC="4", **gpus).stdout
    assert learner.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 ") and "--nproc_per_node=4" in learner
    assert not dry_run(tmp_path, "worker.sh", "1").stdout.startswith("CUDA_VISIBLE_DEVICES")


def test_scripts_refuse_a_missing_config(tmp_path: Path) -> None:
    result = subprocess.run([str(SCRIPTS / "broker.sh")], capture_output=True, text=True, timeout=30,
                            env=script_env(tmp_path, tmp_path / "absent.toml"))
    assert result.returncode == 2 and "absent.toml does not exist" in result.stderr


def test_scripts_start_a_broker_a_worker_and_a_learner(procs: Processes, tmp_path: Path,
                                                       tiny_model_dir: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
group_size = 2
groups_per_step = 2
[model]
path = "{tiny_model_dir}"
[broker]
heartbeat_interval_s = 0.2
[worker]
backend = "sim"
[worker.sim]
tokens_per_s = 20000.0
mean_tokens = 4.0
vocab_size = 64
[learner]
num_threads = 1
checkpoint_every = 0
[integrity]
check = false
""")
    env = script_env(tmp_path, config, LORAFLOW_BIND="tcp://127.0.0.1:0")
    broker = procs.spawn("broker", [str(SCRIPTS / "broker.sh")], env=env)
    endpoint_file = tmp_path / "run" / "broker" / "endpoint"
    wait_for(lambda: endpoint_file.is_file() or not broker.alive(), 60, "the broker to bind", procs)
    endpoint = endpoint_file.read_text().strip()
    env["LORAFLOW_ENDPOINT"] = endpoint
    worker = procs.spawn("worker", [str(SCRIPTS / "worker.sh"), "1"], env=env)
    learner = procs.spawn("learner", [str(SCRIPTS / "learner.sh")], env=env)

    def trained() -> bool:
        stats = fetch_stats(endpoint)
        return stats["latest_version"] >= 2 and len(stats["workers"]) == 1

    wait_for(trained, 120, "the learner to publish two versions from the sim worker's groups", procs)
    assert fetch_stats(endpoint)["workers"][0]["id"] == f"{socket.gethostname().split('.')[0]}-1"
    for proc in (worker, learner, broker):
        proc.signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.log()


def run_keeping_exit_code(tmp_path: Path, child: str, **popen: object) -> subprocess.Popen:
    """bash running common.sh's loraflow_exec_keeping_exit_code on ``python -c child`` (as learner.sh runs
    torchrun), in its own process group like a systemd unit's."""
    script = f'source "{SCRIPTS / "common.sh"}"; loraflow_exec_keeping_exit_code "{sys.executable}" -c "$CHILD"'
    env = {**os.environ, "CHILD": child, "TMPDIR": str(tmp_path)}
    return subprocess.Popen(["bash", "-c", script], env=env, start_new_session=True, stderr=subprocess.PIPE,
                            text=True, **popen)


@pytest.mark.parametrize(("writes", "exits", "expected"), [
    ("4", 1, 4),  # torchrun says 1 when rank 0 was replaced (4): the unit must see 4
    ("2", 1, 2),  # a config error on every rank
    ("", 1, 1),  # a crash: restarted
    ("7", 1, 1),  # only 2 and 4 are passed on
    ("4", 0, 0),  # torchrun itself succeeded
])
def test_learner_script_passes_a_ranks_exit_code_through_torchrun(tmp_path: Path, writes: str, exits: int,
                                                                   expected: int) -> None:
    child = (f"import os, sys; w = {writes!r}\n"
             "if w: open(os.environ['LORAFLOW_EXIT_CODE_FILE'], 'w').write(w + '\\n')\n"
             f"sys.exit({exits})")
    proc = run_keeping_exit_code(tmp_path, child)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == expected, stderr
    assert ("a learner rank exited with" in stderr) == (expected != exits)
    assert not list(tmp_path.glob("loraflow-exit.*"))  # the code file is removed


def test_learner_script_waits_for_torchrun_after_sigterm(tmp_path: Path) -> None:
    """systemd sends SIGTERM to every process of the unit: the script must outlive the child's clean stop (its
    exit code is the unit's), not die with the signal."""
    done = tmp_path / "child-done"
    child = ("import signal, sys, time\n"
             "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"  # no window between ready and wait
             "print('ready', flush=True)\n"
             "signal.sigwait({signal.SIGTERM})\n"
             f"time.sleep(0.5); open({str(done)!r}, 'w').write('x'); sys.exit(0)")
    proc = run_keeping_exit_code(tmp_path, child, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert done.is_file()
