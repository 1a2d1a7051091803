"""The hosts of the multi-host test bed and their network: Linux network namespaces cabled (veths) to a bridge in
a "switch" namespace, with the link faults a machine room has (a pulled cable, a token bucket, a power cut).
The one owner of every namespace a bed makes (:class:`Network`; :func:`sweep_orphans` for those whose creator
died). Needs root and iproute2. The loraflow roles on these hosts are bench/netbed.py's.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Network.transfer_s's ends (argv: address, port, bytes): a sink answering the last byte, a sender timing the answer
_SINK = ("import socket,sys\ns=socket.create_server((sys.argv[1],int(sys.argv[2])))\nprint('up',flush=True)\n"
         "c,_=s.accept()\nc.makefile('rb').read(int(sys.argv[3]))\nc.sendall(b'k')\n")
_SENDER = ("import socket,sys,time\nt=time.monotonic()\nc=socket.create_connection((sys.argv[1],int(sys.argv[2])))\n"
           "c.sendall(bytes(int(sys.argv[3])))\nc.recv(1)\nprint(time.monotonic()-t)\n")


class BedUnavailable(RuntimeError):
    """The machine cannot host the bed (not root, no ``ip``)."""


def require_root() -> None:
    if os.geteuid() != 0:
        raise BedUnavailable("the multi-host test bed makes network namespaces: run it as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise BedUnavailable(f"the multi-host test bed needs '{tool}' (apt-get install iproute2)")


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _ip(ns: str, *commands: str) -> None:
    for command in commands:  # each as typed after ``ip -n <ns>``: "link set eth0 up"
        _sh("ip", "-n", ns, *command.split())


@dataclass
class Network:
    """Hosts as namespaces cabled (veths) to a bridge in a "switch" namespace; host i is ``<prefix>.<i + 2>``/24."""

    hosts: list[str]
    prefix: str = "10.231.7"
    tag: str = field(default_factory=lambda: f"{os.getpid()}.{os.urandom(2).hex()}")  # the creator's: sweep_orphans
    made: list[str] = field(default_factory=list)  # the namespaces made so far: what destroy() removes

    def ns(self, host: str) -> str:
        return f"lf{self.tag}-{host}"

    @property
    def switch(self) -> str:
        return f"lf{self.tag}-switch"

    def port(self, host: str) -> str:
        """The switch side of the host's cable (at most 15 characters, unique in the switch namespace)."""
        return f"p{self.hosts.index(host)}"

    def address(self, host: str) -> str:
        return f"{self.prefix}.{self.hosts.index(host) + 2}"

    def create(self) -> Network:
        require_root()
        sweep_orphans()
        names = "".join(f"{self.address(h)} {h}\n" for h in self.hosts)
        try:
            for ns in [self.switch, *map(self.ns, self.hosts)]:
                _sh("ip", "netns", "add", ns)
                self.made.append(ns)
            _ip(self.switch, "link add br0 type bridge", "link set br0 up")
            for host in self.hosts:
                ns, port, etc = self.ns(host), self.port(host), Path("/etc/netns") / self.ns(host)
                _ip(self.switch, f"link add {port} type veth peer name eth0 netns {ns}", f"link set {port} master br0 up")
                _ip(ns, f"addr add {self.address(host)}/24 dev eth0", "link set eth0 up", "link set lo up")
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        except BaseException:
            self.destroy()
            raise
        return self

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its namespace, with its own hostname (a UTS namespace), as on a machine."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *argv]

    def pids(self, host: str) -> list[int]:
        return _pids(self.ns(host))

    def kill_host(self, host: str) -> list[int]:  # a power cut: every process SIGKILLed; their pids
        return _kill(self.ns(host))

    def link(self, host: str, up: bool) -> None:
        """Pull (or plug back) the host's cable: its switch port goes down, the host sees no carrier."""
        _ip(self.switch, f"link set {self.port(host)} {'up' if up else 'down'}")

    def unplug(self, host: str, down_s: float) -> tuple[float, float]:
        """The host's cable out for ``down_s``: (when it was pulled, when it was back)."""
        t_down = time.time()
        self.link(host, False)
        time.sleep(down_s)
        self.link(host, True)
        return t_down, time.time()

    def limit(self, host: str, rate: str | None) -> None:
        """A token bucket of ``rate`` (tc syntax, e.g. 2mbit) on the host's link, both ways; None lifts it."""
        for ns, dev in ((self.ns(host), "eth0"), (self.switch, self.port(host))):
            tc = f"replace dev {dev} root tbf rate {rate} burst 16kb latency 500ms" if rate else f"del dev {dev} root"
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", *tc.split(), check=rate is not None)

    def transfer_s(self, src: str, dst: str, num_bytes: int, port: int = 6999, timeout_s: float = 30.0) -> float:
        """Seconds to move ``num_bytes`` over TCP from ``src`` to ``dst``: what the link carries, loraflow aside."""
        args = [self.address(dst), str(port), str(num_bytes)]
        sink = subprocess.Popen(["ip", "netns", "exec", self.ns(dst), sys.executable, "-c", _SINK, *args],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "up", "the listener did not start"
            return float(subprocess.run(["ip", "netns", "exec", self.ns(src), sys.executable, "-c", _SENDER, *args],
                                        capture_output=True, text=True, timeout=timeout_s, check=True).stdout)
        finally:
            sink.kill()
            sink.wait()

    def destroy(self) -> None:
        """Every namespace made removed (hosts before the switch), with its processes, veths and hosts file."""
        while self.made:
            _remove(self.made.pop())


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def _kill(ns: str) -> list[int]:
    pids = _pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _remove(ns: str) -> None:
    """The namespace's processes SIGKILLed (10 s at most to go), then the namespace and its hosts file removed."""
    _kill(ns)
    deadline = time.monotonic() + 10
    while _pids(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    _sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def sweep_orphans() -> list[str]:
    """Remove the namespaces and hosts files of beds whose creator is gone (``lf<pid>.<hex>-<host>``, no pid)."""
    orphans = [ns for ns in _sh("ip", "netns", "list", check=False).stdout.split()
               if (made := re.fullmatch(r"lf(\d+)\.[0-9a-f]{4}-[\w-]+", ns)) and not Path(f"/proc/{made[1]}").exists()]
    for ns in orphans:
        _remove(ns)
    return orphans
