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
Code that runs several user functions in one guarded call (an environment step, then a per-sample reward)
raises :class:`Attributed` to say which of them failed; the outcome's ``function`` then names it.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FAILURE_REASONS = ("exception", "timeout", "nan", "type")


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
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True,
                                        name=f"guarded-{getattr(fn, '__name__', 'call')}")
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
            return self._outcome

    def wait(self) -> Outcome:
        """Block until the call returns or times out."""
        self._finished.wait(max(0.0, self.deadline - time.monotonic()))
        outcome = self.poll(max(time.monotonic(), self.deadline))
        assert outcome is not None
        return outcome


def _failed(exc: BaseException) -> Outcome:
    if isinstance(exc, InvalidReward):
        return Outcome(failure=exc.reason, error=str(exc))
    return Outcome(failure="exception", error=f"{type(exc).__name__}: {exc}"[:500])


def call_guarded(fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> Outcome:
    """Run user code synchronously with the same protection."""
    return GuardedCall(fn, *args, timeout_s=timeout_s, **kwargs).wait()
