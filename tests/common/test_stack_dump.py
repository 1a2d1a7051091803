"""``kill -USR1`` on a loraflow process writes every thread's stack to its log and the process goes on."""

from __future__ import annotations

import signal
import sys
import textwrap
from pathlib import Path

from tests.support import Processes, wait_for

CHILD = textwrap.dedent("""
    import threading, time
    from loraflow.common.logging import setup_logging

    def waiting_in_a_helper_thread():
        time.sleep(60)

    def serving_in_the_main_thread():
        print("ready", flush=True)
        while True:
            time.sleep(0.05)

    setup_logging("test")
    threading.Thread(target=waiting_in_a_helper_thread, daemon=True).start()
    serving_in_the_main_thread()
""")


def test_sigusr1_writes_every_threads_stack_and_the_process_goes_on(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    try:
        proc = procs.spawn("child", [sys.executable, "-c", CHILD])
        wait_for(lambda: "ready" in proc.log(), 60, "the child to start", procs)
        proc.signal(signal.SIGUSR1)
        wait_for(lambda: "serving_in_the_main_thread" in proc.log() and "waiting_in_a_helper_thread" in proc.log(),
                 30, "both threads' stacks in the log", procs)
        assert proc.alive()
        proc.signal(signal.SIGUSR1)  # and again: the handler stays
        wait_for(lambda: proc.log().count("serving_in_the_main_thread") >= 2, 30, "a second dump", procs)
        assert proc.alive()
    finally:
        procs.cleanup()
