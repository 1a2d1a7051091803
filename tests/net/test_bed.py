"""The test bed's network itself: hosts reach each other over the bridge and nothing else, a pulled cable cuts a
host off, and everything (processes, namespaces, veths, bridge, hosts files) is gone after a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.netns import BedUnavailable, Network, require_root, sweep_orphans

pytestmark = pytest.mark.net

SERVER = "import socket; s = socket.create_server(('0.0.0.0', 7000)); c, _ = s.accept(); c.sendall(b'hello'); c.close()"
CLIENT = ("import socket, sys; s = socket.create_connection((sys.argv[1], 7000), timeout=2); "
          "print(s.recv(5).decode())")


def _run(net: Network, host: str, code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(net.argv(host, [sys.executable, "-c", code, *args]), capture_output=True, text=True,
                          timeout=20)


def _connect(net: Network, client: str, server: str) -> subprocess.CompletedProcess:
    """A TCP exchange from ``client`` to ``server`` by name (the hosts file), with a fresh server each time."""
    proc = subprocess.Popen(net.argv(server, [sys.executable, "-c", SERVER]))
    try:
        for _ in range(50):  # until the server listens
            done = _run(net, client, CLIENT, server)
            if done.returncode == 0 or "refused" not in done.stderr:
                return done
            time.sleep(0.1)
        return done
    finally:
        proc.kill()
        proc.wait()


def test_hosts_talk_over_the_bridge_only(root_and_ip: None) -> None:
    net = Network(["a", "b"], prefix="10.231.9").create()
    try:
        assert _connect(net, "a", "b").stdout.strip() == "hello"
        hostname = subprocess.run(net.argv("b", ["hostname"]), capture_output=True, text=True, timeout=10)
        assert hostname.stdout.strip() == "b"
        routes = subprocess.run(["ip", "-n", net.ns("a"), "route"], capture_output=True, text=True, timeout=10)
        assert "default" not in routes.stdout and routes.stdout.strip().startswith("10.231.9.0/24"), routes.stdout
        own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        assert "10.231.9." not in own, "the machine's own namespace got a test address"
        net.link("b", False)
        cut = _connect(net, "a", "b")
        assert cut.returncode != 0 and "hello" not in cut.stdout
        net.link("b", True)
        assert _connect(net, "a", "b").stdout.strip() == "hello"
    finally:
        net.destroy()


def test_everything_goes_after_a_failure(root_and_ip: None) -> None:
    net = Network(["a"], prefix="10.231.10")
    sleeper = None
    with pytest.raises(RuntimeError, match="a failed test"):
        try:
            net.create()
            sleeper = subprocess.Popen(net.argv("a", ["sleep", "300"]), start_new_session=True)
            wait = time.monotonic() + 10
            while not net.pids("a") and time.monotonic() < wait:
                time.sleep(0.05)
            assert net.pids("a")
            raise RuntimeError("a failed test")
        finally:
            names = [net.ns("a"), net.switch]
            net.destroy()
    assert sleeper is not None and sleeper.wait(timeout=10) == -9, "the host's process outlived the bed"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not any(name in listed for name in names), listed
    assert not any((Path("/etc/netns") / name).exists() for name in names)


def test_without_root_or_ip_it_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BedUnavailable, match="run it as root"):
        require_root()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "ip" else f"/usr/sbin/{tool}")
    with pytest.raises(BedUnavailable, match="needs 'ip'.*iproute2"):
        require_root()
    with pytest.raises(BedUnavailable):
        Network(["a"]).create()  # nothing made before the check


def test_a_bed_whose_creator_was_killed_is_swept(root_and_ip: None) -> None:
    """A creator SIGKILLed before its teardown leaves its namespaces; the next bed's create() removes them."""
    code = textwrap.dedent("""
        import os, signal, sys
        from bench.netns import Network
        net = Network(["a"], prefix="10.231.11").create()
        print(net.ns("a"), net.switch, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    names = done.stdout.split()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert all(name in listed for name in names), "the killed creator's namespaces should still be there"
    swept = sweep_orphans()
    assert set(names) <= set(swept)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not any(name in listed for name in names) and not any((Path("/etc/netns") / n).exists() for n in names)
