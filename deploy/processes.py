"""Child processes of ``loraflow run``: start, watch, restart with backoff, stop cleanly.

A :class:`Managed` process is one role instance (``broker``, ``learner``, ``worker-3``) with its command line and
log file (``<run_dir>/logs/<name>.log``, appended across restarts). Every start and exit is appended to
``<run_dir>/processes.jsonl`` (``{"t", "process", "event": "start"|"exit", "pid", "code"}``), which the timeline
plot uses to end a lane when its process ended. Children run in their own session, so a
ctrl-C in the terminal reaches only the launcher, which then stops them in order (see
:meth:`Supervisor.stop_all`).

Restart policy, checked by :meth:`Supervisor.check`:

- a child that exits with 0 has finished (the learner after ``run.num_steps``); it is not restarted;
- exit code 2 is a config-class error (:class:`ConfigClassExit`: ``loraflow run`` exits 2 as well): a setting
  that cannot work, found at start-up ("refused to start"), or a stop in the middle of the run that a restart
  would repeat (an adapter the engine refuses, a reward failing on every sample: "stopped with a config-class
  error"); which of the two is told by the child's timeline (``<run_dir>/timeline/<name>.jsonl``: a state past
  ``starting`` in this incarnation's life). Exit code 4 is a learner fenced by the broker because another
  learner process took over the run (``loraflow.common.cli``). Restarting cannot help, so both are fatal at once;
- any other exit (a crash, a kill) is restarted after ``restart_backoff_s``, doubling up to ``max_backoff_s``;
  a child that then stays up for ``STABLE_S`` gets its backoff reset;
- more than ``max_restarts`` consecutive failures is fatal: the run ends with an error naming the process,
  its exit code and the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraflow.common.cli import EXIT_CONFIG_ERROR, EXIT_REPLACED
from loraflow.common.logging import get_logger
from loraflow.common.timeline import read_lives
from loraflow.deploy.rundir import append_jsonl


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (its children, theirs, ...), read from /proc; none where there is no
    /proc."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    ppid = int(Path(entry.path, "stat").read_text().rpartition(")")[2].split()[1])
                    children.setdefault(ppid, []).append(int(entry.name))
    below, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            below.append(child)
            todo.append(child)
    return below


def signal_tree(pid: int, sig: int) -> None:
    """``sig`` to ``pid``'s session (a child started with ``start_new_session``: vLLM's engine core is in it); a
    SIGKILL also to every process below ``pid``. torchrun starts each rank in a session of its own and forwards a
    SIGTERM to them itself, but a SIGKILLed torchrun forwards nothing: its ranks would live on without it."""
    below = descendants(pid) if sig == signal.SIGKILL else []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    for child in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, sig)


log = get_logger("launcher")

STABLE_S = 60.0


class Unrecoverable(RuntimeError):
    """A child keeps failing (or cannot start at all); the message names it and shows its log."""


class ConfigClassExit(Unrecoverable):
    """A child exited with EXIT_CONFIG_ERROR: its config cannot work here, so ``loraflow run`` exits 2 too."""


def config_class_exit(child: Managed) -> ConfigClassExit:
    """The error for a child that exited 2: whether it had started, the last line of its log (a role's config
    error is one line, its last: a start-up check's, or a worker's ``reward_failing`` / ``adapter_refused``),
    then where the log is and its tail."""
    tail = child.log_tail()
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    if child.had_started():
        what = (f"stopped with a config-class error (exit code {EXIT_CONFIG_ERROR}, after "
                f"{time.monotonic() - child.started_s:.0f} s running; a restart would repeat it)")
    else:
        what = f"refused to start (exit code {EXIT_CONFIG_ERROR}: a usage or config error)"
    return ConfigClassExit(f"{child.name} {what}{': ' + last if last else ''}; see {child.log_path}:\n{tail}")


@dataclass(slots=True, kw_only=True)
class RestartPolicy:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5


@dataclass(slots=True, kw_only=True)
class Managed:
    """One supervised child: how to start it, and what happened to it so far."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    cwd: Path | None = None
    timeline_path: Path | None = None  # the child's timeline file (loraflow.common.timeline), when it writes one
    popen: subprocess.Popen | None = None
    started_s: float = 0.0
    started_unix: float = 0.0
    failures: int = 0  # consecutive failed runs (reset after STABLE_S of uptime)
    num_restarts: int = 0
    restart_at_s: float | None = None  # a restart is scheduled for this monotonic time
    finished: bool = False  # exited 0 on its own
    exit_recorded: bool = False  # the exit of the current incarnation was recorded
    terminating: bool = False  # this incarnation got its SIGTERM (a second one could land in its clean exit)
    exit_codes: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"----- {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            log_file.flush()
            self.popen = subprocess.Popen(self.argv, stdout=log_file, stderr=subprocess.STDOUT, env=self.env,
                                          cwd=self.cwd, start_new_session=True)
        self.started_s, self.started_unix = time.monotonic(), time.time()
        self.restart_at_s = None
        self.terminating = False
        log.info("process_started", process=self.name, pid=self.popen.pid)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole session; SIGTERM only once per incarnation: Python restores the
        default handler while it finalizes, so a second SIGTERM during a clean exit would kill it (-15)."""
        if sig == signal.SIGTERM:
            if self.terminating:
                return
            self.terminating = True
        if self.alive():
            assert self.popen is not None
            signal_tree(self.popen.pid, sig)

    def wait(self, timeout_s: float) -> int | None:
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return None

    def had_started(self) -> bool:
        """This incarnation got past its start-up: its timeline holds a life begun since it was started with a
        state other than ``starting`` (connected, model loaded). False without a timeline (the broker)."""
        if self.timeline_path is None or not self.timeline_path.is_file():
            return False
        return any(life.start_s >= self.started_unix and any(s != "starting" for _, s in life.transitions)
                   for life in read_lives(self.timeline_path))

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, self.log_path.stat().st_size - num_chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class Supervisor:
    """Starts children, restarts the ones that crash, and stops them all in a given order."""

    def __init__(self, policy: RestartPolicy, on_event: Callable[[str], None] = lambda line: None,
                 events_path: Path | None = None) -> None:
        self.policy = policy
        self.on_event = on_event
        self.events_path = events_path
        self.children: dict[str, Managed] = {}

    def add(self, child: Managed, *, start: bool = True) -> Managed:
        self.children[child.name] = child
        if start:
            self._start(child)
        return child

    def _start(self, child: Managed) -> None:
        child.start()
        child.exit_recorded = False
        self._record(child, "start", pid=child.pid)

    def _exited(self, child: Managed, code: int) -> None:
        child.exit_codes.append(code)
        child.exit_recorded = True
        self._record(child, "exit", pid=child.pid, code=code)

    def _record(self, child: Managed, event: str, **fields: object) -> None:
        if self.events_path is not None:
            append_jsonl(self.events_path, {"t": round(time.time(), 4), "process": child.name, "event": event,
                                            **fields})

    def check(self, now_s: float | None = None) -> list[Managed]:
        """Handle exits and due restarts; returns children that finished (exit 0) since the last call."""
        now_s = time.monotonic() if now_s is None else now_s
        finished = []
        for child in self.children.values():
            if child.popen is None or child.finished or (child.exit_recorded and child.restart_at_s is None):
                continue  # not started, done, or stopped on purpose
            if child.restart_at_s is not None:
                if now_s >= child.restart_at_s:
                    child.num_restarts += 1
                    self._start(child)
                continue
            code = child.popen.poll()
            if code is None:
                if child.failures and now_s - child.started_s >= STABLE_S:
                    child.failures = 0
                continue
            self._exited(child, code)
            if code == 0:
                child.finished = True
                finished.append(child)
                log.info("process_finished", process=child.name)
                continue
            self._failed(child, code, now_s)
        return finished

    def _failed(self, child: Managed, code: int, now_s: float) -> None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if code == EXIT_CONFIG_ERROR:
            raise config_class_exit(child)
        if code == EXIT_REPLACED:
            raise Unrecoverable(f"{child.name} was replaced by another learner process connected to the same "
                                f"broker ({how}); stop the other one first; see {child.log_path}:\n{child.log_tail()}")
        child.failures += 1
        if child.failures > self.policy.max_restarts:
            raise Unrecoverable(f"{child.name} failed {child.failures} times in a row (last: {how}); giving up "
                                f"(launch.max_restarts = {self.policy.max_restarts}); see {child.log_path}:\n"
                                f"{child.log_tail()}")
        delay_s = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (child.failures - 1))
        child.restart_at_s = now_s + delay_s
        log.warning("process_died", process=child.name, how=how, restart_in_s=delay_s, failures=child.failures)
        self.on_event(f"{child.name} stopped unexpectedly ({how}); restarting in {delay_s:.0f} s "
                      f"(failure {child.failures} of at most {self.policy.max_restarts})")

    def signal(self, names: list[str], sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the named children that are running and cancel their pending restarts."""
        for name in names:
            if name in self.children:
                child = self.children[name]
                child.restart_at_s = None
                child.signal(sig)

    def stop(self, names: list[str], timeout_s: float) -> None:
        """SIGTERM the named children, wait up to ``timeout_s`` together, SIGKILL whatever is left."""
        self.signal(names)
        targets = [self.children[n] for n in names if n in self.children]
        deadline = time.monotonic() + timeout_s
        for child in targets:
            if child.popen is None or child.exit_recorded:
                continue  # never started, or its exit was handled already
            code = child.wait(deadline - time.monotonic())
            if code is None:
                log.warning("process_killed", process=child.name, after_s=timeout_s)
                self.on_event(f"{child.name} did not stop within {timeout_s:.0f} s; killed")
                child.signal(signal.SIGKILL)
                code = child.wait(10)
            if code is not None:
                self._exited(child, code)

    def kill_all(self) -> None:
        self.signal(list(self.children), signal.SIGKILL)
        for child in self.children.values():
            if child.popen is not None and not child.exit_recorded and (code := child.wait(10)) is not None:
                self._exited(child, code)
