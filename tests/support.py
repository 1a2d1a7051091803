"""Helpers for tests that run real processes on loopback: spawn, wait for a condition, clean up by pid.

Processes are started with ``sys.executable -m <package>`` and their output goes to a log file in the
test's tmp dir (printed when a wait fails). Every process started through :class:`Processes` is killed at
the end of the test, whatever happened. Waits poll a condition with a deadline; a timeout names what was
awaited and shows the logs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow.common.cli import one_host_torchrun
from loraflow.common.transport import fetch_stats
from loraflow.deploy.processes import descendants, signal_tree

REPO = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a SIGABRT (stacks_and_abort) writes every thread's stack to the log
    env.update(extra)
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.returncode

    def wait(self, timeout_s: float) -> int:
        """Its exit code; past ``timeout_s`` every process of its session writes its stacks and is aborted, and the
        test fails with the log's tail (where a hung process was waiting)."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stacks_and_abort(self.popen)
            raise AssertionError(f"{self.name} did not exit in {timeout_s:.0f} s:\n{self.log()[-6000:]}") from None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Processes:
    """Starts processes for one test and kills whatever is left at the end."""

    tmp_path: Path
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
        log_path = self.tmp_path / f"{name}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - owned by the child process
        popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env or child_env(),
                                 cwd=cwd or REPO, start_new_session=True)
        log_file.close()
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def python(self, name: str, module: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        return self.spawn(name, [sys.executable, "-m", module, *args], env=env)

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} (pid {p.pid}) -----\n{p.log()[-4000:]}" for p in self.procs)

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.alive():
                signal_tree(proc.pid, signal.SIGKILL)  # torchrun's ranks too (sessions of their own)
                proc.popen.wait(timeout=10)


def stacks_and_abort(popen: subprocess.Popen) -> None:
    """SIGABRT to ``popen``'s process and every process below it (torchrun's ranks): each Python process writes
    its threads' stacks (PYTHONFAULTHANDLER, :func:`child_env`) before it dies; then SIGKILL to what is left."""
    below = descendants(popen.pid)
    for pid in (*below, popen.pid):  # the ranks first: a torchrun told first would stop them itself
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
    time.sleep(2)
    signal_tree(popen.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    popen.wait(timeout=10)


def run_ranks(script: str, ranks: int, *args: str, timeout_s: float = 300, hostname: str = "") -> str:
    """Run ``tests/learner/<script>`` under torchrun on ``ranks`` CPU ranks (gloo); its stdout, after asserting
    that every rank exited 0 (the tail of its output otherwise, and every rank's stacks past ``timeout_s``).
    ``hostname``: the machine's name as the job sees it (a UTS namespace of its own; root)."""
    named = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', hostname] if hostname else []
    popen = subprocess.Popen([*named, sys.executable, *one_host_torchrun(ranks), str(REPO / "tests" / "learner" / script),
                              *args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO,
                             start_new_session=True)
    try:
        out, _ = popen.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stacks_and_abort(popen)
        out, _ = popen.communicate()
        raise AssertionError(f"{script} on {ranks} ranks did not exit in {timeout_s:.0f} s:\n{out[-6000:]}") from None
    assert popen.returncode == 0, out[-6000:]
    return out


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, procs: Processes | None = None,
             interval_s: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` and the logs on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = procs.logs() if procs else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")
        time.sleep(interval_s)


@dataclass
class BrokerHandle:
    proc: Proc
    endpoint: str
    endpoint_file: Path
    run_dir: Path

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return fetch_stats(self.endpoint, timeout_s=timeout_s)

    @property
    def run_token(self) -> str:
        """The token a learner's Hello must carry (security off): the broker wrote it into its run dir."""
        return (self.run_dir / "broker" / "run_token").read_text().strip()


def start_broker(procs: Processes, *overrides: str, name: str = "broker", run_dir: Path | None = None,
                 config: Path | None = None, timeout_s: float = 30.0) -> BrokerHandle:
    """Start ``python -m loraflow.broker`` on an ephemeral loopback port and wait until it has bound."""
    run_dir = run_dir or procs.tmp_path / "run"
    endpoint_file = run_dir / f"{name}.endpoint"
    endpoint_file.unlink(missing_ok=True)
    args = [str(config)] if config else []
    args += ["--run-dir", str(run_dir), "--set", "broker.bind=\"tcp://127.0.0.1:0\"",
             "--set", f"broker.endpoint_file=\"{endpoint_file}\""]
    for override in overrides:
        args += ["--set", override]
    proc = procs.python(name, "loraflow.broker", *args)
    wait_for(lambda: endpoint_file.is_file() and endpoint_file.read_text().strip() or not proc.alive(),
             timeout_s, "the broker to bind", procs)
    if not proc.alive():
        raise AssertionError(f"broker exited with {proc.popen.returncode}\n{proc.log()}")
    return BrokerHandle(proc, endpoint_file.read_text().strip(), endpoint_file, run_dir)


class NoLogging:
    """Stands in for a module's ``log`` where nothing may log (signal handlers): any call fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a signal handler called log.{name}")


@contextlib.contextmanager
def restored_signal_handlers() -> Any:
    """Put back this process's SIGTERM and SIGINT handlers after a test installed its own."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
