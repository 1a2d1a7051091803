"""The broker as the benchmarks start it: ``python -m loraflow.broker`` on a free loopback port, quiet logs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.report import checkout_env

REPO = Path(__file__).resolve().parent.parent
#: the run token of every bench broker (security off: a learner's Hello must carry it, common/run_token.py)
RUN_TOKEN = "bench-run-token"


def start_broker(workdir: Path, *overrides: str, python_args: tuple[str, ...] = (),
                 timeout_s: float = 30.0, tree: Path = REPO) -> tuple[subprocess.Popen, str]:
    """(process, endpoint) of a broker with its run directory in ``workdir``; ``overrides`` are ``--set``
    values (``section.key=value``); ``python_args`` go before ``-m loraflow.broker`` (e.g. cProfile); ``tree``: the
    source tree whose broker runs (another checkout: a before/after in one run)."""
    endpoint_file = workdir / "broker.endpoint"
    endpoint_file.unlink(missing_ok=True)
    argv = [sys.executable, *python_args, "-m", "loraflow.broker", "--run-dir", str(workdir / "run"), "--log-level", "warning",
            "--set", "broker.bind=\"tcp://127.0.0.1:0\"", "--set", f"broker.endpoint_file=\"{endpoint_file}\"",
            "--set", "broker.heartbeat_misses=100", "--set", f'security.run_token="{RUN_TOKEN}"']
    for override in overrides:
        argv += ["--set", override]
    proc = subprocess.Popen(argv, cwd=tree, env=checkout_env(tree))
    deadline = time.monotonic() + timeout_s
    while not (endpoint_file.is_file() and endpoint_file.read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"the broker did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return proc, endpoint_file.read_text().strip()
