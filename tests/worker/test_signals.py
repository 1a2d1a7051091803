"""The worker's SIGTERM / SIGINT handlers only set flags: a handler that logs can hang the process for good
(it may run while the main thread holds the log stream's non-reentrant lock)."""

from __future__ import annotations

import signal
import threading

import pytest

from loraflow.rollout_worker import worker as worker_module
from loraflow.rollout_worker.worker import StoppedWhileStarting, install_stop_handlers
from tests.support import NoLogging, restored_signal_handlers


@pytest.fixture
def handlers(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(worker_module, "log", NoLogging())
    with restored_signal_handlers():
        yield


def test_a_signal_while_looping_sets_the_flags_and_records_its_name(handlers) -> None:
    stop, wake, looping = threading.Event(), threading.Event(), threading.Event()
    received = install_stop_handlers(stop, wake, looping)
    looping.set()
    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    assert stop.is_set() and wake.is_set() and received == ["SIGTERM", "SIGINT"]


def test_a_signal_while_starting_unwinds_without_logging(handlers) -> None:
    stop, wake, looping = threading.Event(), threading.Event(), threading.Event()
    install_stop_handlers(stop, wake, looping)
    with pytest.raises(StoppedWhileStarting, match="SIGTERM"):
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert not stop.is_set()
