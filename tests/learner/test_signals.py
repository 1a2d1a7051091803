"""The learner's SIGTERM / SIGINT handler only sets flags (a handler that logs can hang the process: it may run
while the main thread holds the log stream's non-reentrant lock); the loop logs the stop."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from loraflow.learner import start
from tests.support import NoLogging, restored_signal_handlers


def test_the_stop_handler_sets_flags_and_never_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(start, "log", NoLogging())
    learner = SimpleNamespace(stop_requested=False, stop_signal="")
    with restored_signal_handlers():
        start.install_stop_handlers(learner)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    assert learner.stop_requested and learner.stop_signal == "SIGTERM"  # the first one is the one logged
