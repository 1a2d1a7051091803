"""Running user code (reward functions, environment steps) so that it fails closed.

A reward function or environment may raise, hang or return nonsense; none of it may stop the worker. Each call
runs in a daemon thread of its own (:class:`GuardedCall`); its :class:`Outcome` is either the value or a failure
reason:

- ``exception``: the code raised (the exception text is kept for the log line);
- ``timeout``: no result within ``worker.reward_timeout_s``; the thread is abandoned (Python cannot kill a
  thread; being a daemon it never blocks the worker's exit) and a late result is ignored;
- ``nan`` / ``type``: the reward is not a finite number (:func:`as_reward`).

The caller turns any failure into reward 0, the counters ``reward_failures{reason}`` (samples) and
``reward_failures_by_function{function, reason}``, and a log line.

An abandoned thread that keeps computing is not harmless: it holds the GIL the worker's engine needs between
torch calls (each call gives the GIL up, and a busy thread keeps it for up to the 5-ms switch interval), so hf
generation beside one spinning thread ran 530 -> 2.4 tokens/s here (bench/adapter_load.py), for the rest of the
process's life.
:class:`RunawayWatch` names the abandoned calls whose threads together used at least ``STUCK_CPU_SHARE`` of the
process's CPU time over the last second or more (each thread's CPU time from Linux's /proc; elsewhere none is
found); the worker then restarts (``EXIT_USER_CODE_STUCK``), the one way to be rid of a thread. A call that
hangs waiting (``sleep``, I/O) costs nothing and is left alone.
Code that runs several user functions in one guarded call (an environment step, then a per-sample reward)
raises :class:`Attributed` to say which of them failed; the outcome's ``function`` then names it.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAILURE_REASONS = ("exception", "timeout", "nan", "type")
#: abandoned calls whose threads used at least this share of the process's CPU time are stuck ...
STUCK_CPU_SHARE = 0.5
#: ... measured over at least this long
STUCK_AFTER_S = 1.0
_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class InvalidReward(ValueError):
    """A reward that is not a finite real number; ``reason`` is ``nan`` or ``type``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def as_reward(value: Any) -> float:
    """A finite float from what user code returned, else InvalidReward."""
    if not isinstance(value, numbers.Real):
        raise InvalidReward(f"reward must be a real number, got {type(value).__name__}", "type")
    reward = float(value)
    if not math.isfinite(reward):
        raise InvalidReward(f"reward must be finite, got {reward}", "nan")
    return reward


class Attributed(Exception):
    """A failure of the user function named ``function`` (the original exception is ``error``)."""

    def __init__(self, function: str, error: BaseException) -> None:
        super().__init__(str(error))
        self.function = function
        self.error = error


@dataclass(slots=True)
class Outcome:
    value: Any = None
    failure: str = ""  # "" on success, else one of FAILURE_REASONS
    error: str = ""
    duration_s: float = 0.0
    function: str = ""  # which user function failed, when the call said so (Attributed)

    @property
    def ok(self) -> bool:
        return not self.failure


class GuardedCall:
    """``fn(*args, **kwargs)`` running in a daemon thread with a deadline; ``on_done`` runs when it returns."""

    def __init__(self, fn: Callable[..., Any], *args: Any, timeout_s: float,
                 on_done: Callable[[], None] | None = None, **kwargs: Any) -> None:
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.abandoned = False
        self._outcome: Outcome | None = None
        self._lock = threading.Lock()
        self._on_done = on_done
        self._finished = threading.Event()
        self.name = getattr(fn, "__name__", "call")  # the user function, for a stuck call's report
        self.cpu_at_deadline_s = 0.0  # the thread's CPU seconds when the call was abandoned
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True,
                                        name=f"guarded-{self.name}")
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            outcome = Outcome(value=fn(*args, **kwargs))
        except Attributed as exc:
            outcome = _failed(exc.error)
            outcome.function = exc.function
        except BaseException as exc:  # noqa: BLE001 - user code fails closed, whatever it raises
            outcome = _failed(exc)
        outcome.duration_s = time.monotonic() - self.started
        with self._lock:
            if self.abandoned:
                return
            self._outcome = outcome
        self._finished.set()
        if self._on_done is not None:
            self._on_done()

    def poll(self, now: float | None = None) -> Outcome | None:
        """The outcome once the call returned or its deadline passed (then a timeout); else None."""
        with self._lock:
            if self._outcome is not None:
                return self._outcome
            if (now if now is not None else time.monotonic()) < self.deadline:
                return None
            self.abandoned = True
            self._outcome = Outcome(failure="timeout", error=f"no result within {self.timeout_s:g} s "
                                    "(worker.reward_timeout_s)", duration_s=self.timeout_s)
        self.cpu_at_deadline_s = self.thread_cpu_s()
        with _abandoned_lock:
            _abandoned.append(self)
        return self._outcome

    @property
    def running(self) -> bool:
        """Whether the call's thread is still running (an abandoned call's may be)."""
        return self._thread.is_alive()

    def thread_cpu_s(self) -> float:
        """CPU seconds the call's thread has used, from Linux's /proc (0 once it ended, or off Linux)."""
        try:
            stat = Path(f"/proc/self/task/{self._thread.native_id}/stat").read_text()
            user_ticks, system_ticks = stat[stat.rindex(")") + 2:].split()[11:13]  # fields 14, 15 of proc(5)
            return (int(user_ticks) + int(system_ticks)) / _CLOCK_TICKS_PER_S
        except (OSError, ValueError, IndexError):
            return 0.0

    def wait(self) -> Outcome:
        """Block until the call returns or times out."""
        self._finished.wait(max(0.0, self.deadline - time.monotonic()))
        outcome = self.poll(max(time.monotonic(), self.deadline))
        assert outcome is not None
        return outcome


@dataclass(frozen=True, slots=True)
class StuckCall:
    """An abandoned call still computing: the user function's name, the share of the process's CPU time its
    thread used over the last look, and how long ago its deadline passed."""

    name: str
    cpu_share: float
    past_deadline_s: float


_abandoned: list[GuardedCall] = []  # this process's calls abandoned at their deadline whose threads may still run
_abandoned_lock = threading.Lock()


class RunawayWatch:
    """Whether abandoned calls keep this process busy: between two looks at least ``interval_s`` apart, the share
    of the process's CPU time (all its threads) that the threads of abandoned calls used. Against the process's
    own CPU time, not the wall clock, so a loaded machine, or several runaway threads taking turns at the GIL,
    read the same as one on an idle machine; a call that hangs asleep uses none."""

    def __init__(self, interval_s: float = STUCK_AFTER_S, min_share: float = STUCK_CPU_SHARE) -> None:
        self.interval_s = interval_s
        self.min_share = min_share
        self._at = time.monotonic()
        self._process_cpu_s = time.process_time()
        self._thread_cpu_s: dict[int, float] = {}  # id of a tracked call -> its thread's CPU seconds at the last look

    def check(self) -> list[StuckCall]:
        """The abandoned calls that used CPU since the last look, when together they used at least ``min_share``
        of the process's CPU time (else, or sooner than ``interval_s`` after the last look, none)."""
        now = time.monotonic()
        if now - self._at < self.interval_s:
            return []
        process_cpu_s = time.process_time()
        with _abandoned_lock:
            _abandoned[:] = [c for c in _abandoned if c.running]
            calls = list(_abandoned)
        cpu_s = {id(c): c.thread_cpu_s() for c in calls}
        used_s = [(c, cpu_s[id(c)] - self._thread_cpu_s.get(id(c), c.cpu_at_deadline_s)) for c in calls]
        spent_s = process_cpu_s - self._process_cpu_s
        self._at, self._process_cpu_s, self._thread_cpu_s = now, process_cpu_s, cpu_s
        if spent_s <= 0 or sum(u for _, u in used_s) < self.min_share * spent_s:
            return []
        return [StuckCall(name=c.name, cpu_share=round(u / spent_s, 2), past_deadline_s=round(now - c.deadline, 1))
                for c, u in used_s if u > 0]


def _failed(exc: BaseException) -> Outcome:
    if isinstance(exc, InvalidReward):
        return Outcome(failure=exc.reason, error=str(exc))
    return Outcome(failure="exception", error=f"{type(exc).__name__}: {exc}"[:500])


def call_guarded(fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> Outcome:
    """Run user code synchronously with the same protection."""
    return GuardedCall(fn, *args, timeout_s=timeout_s, **kwargs).wait()
