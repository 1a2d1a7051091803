"""Config-class failures, through the real entry points: one line naming the setting, exit code 2, at once.

Every case runs ``.venv/bin/loraflow <command>`` as a subprocess with a temporary run dir. A worker or learner is
pointed at a port where nothing listens: had a check come after connecting (or after loading a model), the
process would sit in its connect wait instead of exiting within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraflow.common.config import load_config
from loraflow.common.tiny_model import demo_base_link
from loraflow.deploy.launcher import DEMO_CONFIG, Launch
from loraflow.deploy.progress import Display
from tests.support import child_env, start_broker, wait_for

LORAFLOW = str(Path(sys.executable).with_name("loraflow"))
EXIT_S = 20.0  # generous on a busy 2-core machine; a connect wait or a model load would take longer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loraflow(cwd: Path, *args: str, timeout_s: float = EXIT_S) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([LORAFLOW, *args], env=child_env(LORAFLOW_CACHE=str(cwd / "cache")), cwd=cwd,
                            capture_output=True, text=True, timeout=timeout_s)
    return result, time.monotonic() - started


def assert_one_line_exit_2(result: subprocess.CompletedProcess, command: str, setting: str) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "config error" in line]
    assert len(errors) == 1, output
    assert errors[0].startswith(f"loraflow {command}: config error: ") and setting in errors[0], output
    assert output.rstrip().splitlines()[-1] == errors[0], output  # the last word, nothing after it
    return errors[0]


# (command, extra args, setting named); {tmp} is the test's directory
CASES = [
    ("worker", ["--model", "{tmp}/absent"], "model.path"),
    ("learner", ["--model", "{tmp}/absent"], "model.path"),
    ("broker", ["--model", "{tmp}/absent"], "model.path"),
    ("worker", ["--model", "{tmp}"], "model.path"),  # a directory, but no config.json
    ("worker", ["--model", "builtin:demo", "--seed", "7"], "python -m loraflow.deploy.demo_base --seed 7"),
    ("learner", ["--model", "builtin:demo"], "python -m loraflow.deploy.demo_base --seed 0"),
    ("broker", ["--model", "builtin:demo"], "python -m loraflow.deploy.demo_base --seed 0"),
    ("learner", ["--model", "builtin:huge"], "model.path"),
    ("worker", ["--model", "builtin:agent-demo", "--seed", "2"], "python -m loraflow.deploy.agent_base --seed 2"),
    ("worker", ["--backend", "sim", "--set", 'worker.reward="no_such_module:score"'], "worker.reward"),
    ("worker", ["--backend", "sim", "--set", 'worker.reward="loraflow.common.tasks:NO_SUCH_NAME"'], "worker.reward"),
    ("worker", ["--backend", "sim", "--set", 'worker.env="no_such_module:Env"'], "worker.env"),
    ("worker", ["--backend", "sim", "--set", 'worker.env="loraflow.common.tasks:ArithTask"'], "worker.env"),
    ("worker", ["--backend", "sim", "--run-dir", "{tmp}/a_file/run"], "run.run_dir"),
    ("learner", ["--run-dir", "{tmp}/a_file/run"], "run.run_dir"),
    ("broker", ["--set", 'broker.state_path="{tmp}/a_file/state.json"'], "broker.state_path"),
    ("broker", ["--set", 'run.task="{tmp}/absent.jsonl"'], "run.task"),
    ("worker", ["--set", "worker.no_such_key=1"], "no_such_key"),
    ("learner", ["--set", "learner.lr"], "learner.lr"),  # no '='
    ("learner", ["--device", "cuda:99"], "learner.device"),  # no machine here has 100 GPUs
    ("learner", ["--device", "gpu"], "learner.device"),
    ("worker", ["--device", "gpu"], "worker.device"),
    ("run", ["--set", 'learner.device="cuda:99"'], "learner.device"),
    ("config", ["--set", 'worker.device="cuda:x"'], "worker.device"),
    ("config", ["--set", 'worker.reward="no_such_module:score"'], "worker.reward"),
    ("config", ["--model", "{tmp}/absent"], "model.path"),
    ("run", ["--set", 'worker.reward="no_such_module:score"'], "worker.reward"),
    ("run", ["--model", "{tmp}/absent"], "model.path"),
]


@pytest.mark.parametrize(("command", "args", "setting"), CASES,
                         ids=[f"{c}-{s}-{i}" for i, (c, _, s) in enumerate(CASES)])
def test_a_config_error_is_one_line_and_exit_2_at_once(tmp_path: Path, command: str, args: list[str],
                                                        setting: str) -> None:
    (tmp_path / "a_file").write_text("not a directory\n")
    run_dir = tmp_path / "run"
    argv = [command, "--run-dir", str(run_dir), *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    if command in ("worker", "learner"):
        argv += ["--endpoint", f"tcp://127.0.0.1:{free_port()}"]  # nobody there: a late check would wait
    result, elapsed_s = loraflow(tmp_path, *argv)
    assert_one_line_exit_2(result, command, setting.replace("{tmp}", str(tmp_path)))
    assert elapsed_s < EXIT_S
    if command == "run":  # refused before anything was created or started: no run dir, no restart loop
        assert not run_dir.exists(), result.stdout


def test_a_taken_port_names_the_setting(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for setting in ("broker.bind", "broker.endpoint"):
            result, _ = loraflow(tmp_path, "broker", "--run-dir", str(tmp_path / "run"), "--set",
                                 f'{setting}="tcp://127.0.0.1:{port}"')
            line = assert_one_line_exit_2(result, "broker", setting)
            assert f"tcp://127.0.0.1:{port} is in use" in line and "another broker may be running" in line


@pytest.mark.parametrize(("command", "setting"), [("broker", "broker.metrics_port"), ("worker", "worker.metrics_port"),
                                                 ("learner", "learner.metrics_port"), ("run", "learner.metrics_port")])
def test_a_taken_metrics_port_is_refused_before_connecting(tmp_path: Path, command: str, setting: str) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [command, "--run-dir", str(tmp_path / "run"), "--set", f"{setting}={port}"]
        if command in ("worker", "learner"):
            args += ["--endpoint", f"tcp://127.0.0.1:{free_port()}"]
        result, _ = loraflow(tmp_path, *args, "--backend", "sim") if command == "worker" else loraflow(tmp_path, *args)
    assert f"{setting} = {port}: the port cannot be bound here" in assert_one_line_exit_2(result, command, setting)


@pytest.mark.parametrize(("sets", "message"), [
    (["worker.metrics_port=9401", "launch.num_workers=2", "learner.metrics_port=9402"],  # worker-2 gets 9402
     "worker.metrics_port + 1 (worker-2) = 9402 is learner.metrics_port too"),
    (["broker.metrics_port=9401", "learner.metrics_port=9401"], "learner.metrics_port = 9401 is broker.metrics_port"),
])
def test_loraflow_run_refuses_metrics_ports_its_processes_would_share(tmp_path: Path, sets: list[str],
                                                                        message: str) -> None:
    result, _ = loraflow(tmp_path, "run", "--run-dir", str(tmp_path / "run"), *(f"--set={s}" for s in sets))
    assert message in assert_one_line_exit_2(result, "run", sets[0].split("=")[0])
    assert not (tmp_path / "run").exists()


def test_loraflow_run_exits_2_when_its_broker_cannot_bind(tmp_path: Path, tiny_model_dir: Path) -> None:
    # found by the broker child, not by the checks before it: the run stops at once, the broker started once
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, _ = loraflow(tmp_path, "run", "--run-dir", str(tmp_path / "run"), "--model", str(tiny_model_dir),
                             "--set", f'broker.bind="tcp://127.0.0.1:{port}"', timeout_s=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "broker refused to start (exit code 2: a usage or config error): loraflow broker: config error: " \
           f"broker.bind: tcp://127.0.0.1:{port} is in use" in result.stdout
    events = [json.loads(line) for line in (tmp_path / "run" / "processes.jsonl").read_text().splitlines()]
    assert [(e["process"], e["event"]) for e in events] == [("broker", "start"), ("broker", "exit")]
    assert "Traceback" not in result.stdout + result.stderr


def fake_demo_base(cache: Path, seed: int, vocab_size: int) -> Path:
    """What loraflow.deploy.demo_base leaves in the cache (the files a broker reads): a base dir and the seed's link."""
    base = cache / f"demo-s{seed}-0123abcd"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    (base / "loraflow_model.json").write_text(json.dumps({"kind": "demo", "seed": seed}))
    os.symlink(base.name, demo_base_link(seed, cache))
    return base


def test_builtin_demo_is_found_by_a_role_started_by_hand(tmp_path: Path, procs) -> None:
    base = fake_demo_base(tmp_path / "cache", seed=3, vocab_size=123)
    broker = start_broker(procs, 'model.path="builtin:demo"', "run.seed=3", f'model.cache_dir="{tmp_path / "cache"}"')
    log_text = wait_for(lambda: "broker_started" in broker.proc.log() and broker.proc.log(), 10,
                        "the broker's start line", procs)
    assert "vocab_size=123" in log_text  # it read the demo base's config.json
    resolved = load_config(broker.run_dir / "broker" / "config.toml")
    assert resolved.model.path == str(base.resolve())  # pinned to the directory, as loraflow run does
    assert broker.proc.stop() == 0


@pytest.mark.parametrize("args", [["config"], ["config", "--reference"], ["status", "--json"]])
def test_output_cut_off_by_its_reader_ends_quietly(tmp_path: Path, procs, args: list[str]) -> None:
    if args[0] == "status":
        args = [*args, "--endpoint", start_broker(procs).endpoint]
    child = subprocess.Popen([LORAFLOW, *args], env=child_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    child.stdout.close()  # `| head` that has read enough: every write now fails with EPIPE
    _, err = child.communicate(timeout=EXIT_S)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert child.returncode == 128 + signal.SIGPIPE  # as a shell shows `cat` killed by SIGPIPE


def test_no_evaluation_is_scheduled_with_eval_num_prompts_0(tmp_path: Path) -> None:
    adapter = tmp_path / "run" / "learner" / "adapters" / "v3"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    for num_prompts, scheduled in ((0, False), (4, True)):
        config = load_config(DEMO_CONFIG, [f'run.run_dir="{tmp_path / "run"}"', f"eval.num_prompts={num_prompts}",
                                           "eval.every_s=1"])
        launch = Launch(config, Display(every_s=1e9, interactive=False), started_s=0.0)
        launch.maybe_start_eval(now_s=1e6)
        assert (launch.pending_eval is not None) == scheduled  # with 4, a measurement of v3 (it fails: no model)
        launch.evaluator.shutdown(wait=True)


def test_the_launcher_checks_user_code_as_its_children_import_it(tmp_path: Path) -> None:
    # a reward module in the directory `loraflow run` starts in: its `python -m` children import it from there
    (tmp_path / "my_reward.py").write_text("def score(completion, answer, **kw):\n    return 1.0\n")
    result, _ = loraflow(tmp_path, "config", "--set", 'worker.reward="my_reward:score"')
    assert result.returncode == 0, result.stderr
    assert 'reward = "my_reward:score"' in result.stdout


def test_run_main_maps_config_error_classes_only(capsys: pytest.CaptureFixture[str]) -> None:
    from loraflow.common.cli import run_main
    from loraflow.common.config import ConfigError
    from loraflow.common.security import SecurityError

    def raising(exc: BaseException):
        def body() -> int:
            raise exc
        return body

    assert run_main("loraflow x", raising(ConfigError("a.b = 1: must be\n  >= 2"))) == 2
    assert capsys.readouterr().err == "loraflow x: config error: a.b = 1: must be >= 2\n"  # one line
    assert run_main("loraflow x", raising(SecurityError("keys/observer.key_secret is missing"))) == 2
    with pytest.raises(ValueError, match="config error"):  # a ValueError is not a config error, whatever it says
        run_main("loraflow x", raising(ValueError("config error: looks like one")))
    with pytest.raises(BrokenPipeError):  # not stdout's: a real failure, not a reader that went away
        run_main("loraflow x", raising(BrokenPipeError("a socket")))
