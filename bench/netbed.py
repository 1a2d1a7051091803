"""A multi-host loraflow test bed in Linux network namespaces: the hosts, their network, the roles and faults.

:class:`Network`: one namespace per host, veth pairs to a bridge in a namespace of its own (the "switch"), one
address each in a private /24, no route beyond it; each host has its own hostname (a UTS namespace) and an
``/etc/netns/<ns>/hosts`` naming every test host. :meth:`Network.destroy` kills what is left (by pid) and removes
it all, after any failure; names carry the creator's pid, so :func:`sweep_orphans` removes beds of a killed creator.

:class:`Cluster` runs loraflow on those hosts with the scripts the systemd units call (``deploy/scripts`` under
``ip netns exec``): a broker host, a learner of ``learner_nodes`` torchrun nodes (one rank each, c10d on node 0,
gloo, one shared run dir), worker hosts, CURVE on (each client host holds ``broker.key`` and its own secret).
:data:`FAULTS` (bench/net_faults.py, tests/net) measure from the files the roles write: the learner's ledger and
the roles' JSON logs. ``loopback=True`` puts every role on one host: the throughput reference. Needs root and
iproute2 (:func:`require_root`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from loraflow.learner.ledger import read as read_ledger
from tests.fault.ledger import Audit, audit_learner, audit_run, committed_chain, read_json_lines
from tests.fault.system import write_config
from tests.support import Proc, Processes, child_env, wait_for

REPO = Path(__file__).resolve().parent.parent

SCRIPTS = REPO / "deploy" / "scripts"
BROKER_PORT = 5555
RDZV_PORT = 29500
RELAY_PORT = 6555


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


@dataclass
class Network:
    """Hosts as namespaces on one bridge. ``hosts``: names in order; host i gets ``<prefix>.<i + 2>``."""

    hosts: list[str]
    prefix: str = "10.231.7"
    # names carry the creating process's pid, so a bed whose creator was killed outright can be swept later
    tag: str = field(default_factory=lambda: f"{os.getpid()}.{uuid.uuid4().hex[:4]}")
    made: list[str] = field(default_factory=list)  # namespaces made so far (destroy removes exactly these)

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
        try:
            self._add_ns(self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            names = "".join(f"{self.address(h)} {h}\n" for h in self.hosts)
            for host in self.hosts:
                ns = self.ns(host)
                self._add_ns(ns)
                _sh("ip", "-n", self.switch, "link", "add", self.port(host), "type", "veth", "peer", "name", "eth0",
                    "netns", ns)
                _sh("ip", "-n", self.switch, "link", "set", self.port(host), "master", "br0", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self.made.append(ns)

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its namespace, with its own hostname (a UTS namespace), as on a machine."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *argv]

    def pids(self, host: str) -> list[int]:
        return _pids(self.ns(host))

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of the host (a power cut); returns their pids."""
        return _kill(self.ns(host))

    def link(self, host: str, up: bool) -> None:
        """Pull (or plug back) the host's cable: its switch port goes down, the host sees no carrier."""
        _sh("ip", "-n", self.switch, "link", "set", self.port(host), "up" if up else "down")

    def limit(self, host: str, rate: str) -> None:
        """A token bucket of ``rate`` (tc syntax, e.g. 2mbit) on the host's link, both directions."""
        for ns, dev in ((self.ns(host), "eth0"), (self.switch, self.port(host))):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "16kb", "latency", "500ms")

    def unlimit(self, host: str) -> None:
        for ns, dev in ((self.ns(host), "eth0"), (self.switch, self.port(host))):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def transfer_s(self, src: str, dst: str, num_bytes: int, port: int = 6999, timeout_s: float = 30.0) -> float:
        """Seconds to move ``num_bytes`` over TCP from ``src`` to ``dst`` (a listener on ``dst``, a sender on
        ``src``, each in its host's namespace): what the link itself carries now, apart from any loraflow
        message. The sender times connect -> the listener's one-byte answer after it read every byte."""
        listener = ("import socket,sys\ns=socket.create_server((sys.argv[1],int(sys.argv[2])))\nprint('up',flush=True)\n"
                    "c,_=s.accept()\nn=0\nwhile n<int(sys.argv[3]):\n b=c.recv(1<<16)\n if not b: break\n n+=len(b)\n"
                    "c.sendall(b'k')\n")
        sender = ("import socket,sys,time\nt=time.monotonic()\nc=socket.create_connection((sys.argv[1],int(sys.argv[2])))\n"
                  "c.sendall(bytes(int(sys.argv[3])))\nc.recv(1)\nprint(time.monotonic()-t)\n")
        args = [self.address(dst), str(port), str(num_bytes)]
        server = subprocess.Popen(["ip", "netns", "exec", self.ns(dst), sys.executable, "-c", listener, *args],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "up", "the listener did not start"
            done = subprocess.run(["ip", "netns", "exec", self.ns(src), sys.executable, "-c", sender, *args],
                                  capture_output=True, text=True, timeout=timeout_s, check=True)
            return float(done.stdout)
        finally:
            server.kill()
            server.wait()

    def destroy(self) -> None:
        """Every process in the namespaces killed, then namespaces (with their veths and bridge) and hosts files."""
        for ns in self.made:
            _kill(ns)
        deadline = time.monotonic() + 10
        while any(_pids(ns) for ns in self.made) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in reversed(self.made):
            _del(ns)
        self.made.clear()


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def _kill(ns: str) -> list[int]:
    pids = _pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _del(ns: str) -> None:
    _sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def sweep_orphans() -> list[str]:
    """Remove the namespaces (and hosts files) of beds whose creating process is gone: a run killed with SIGKILL
    never reached :meth:`Network.destroy`. Only names this module makes (``lf<pid>.<hex>-<host>``) are touched."""
    swept = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        match = re.fullmatch(r"lf(\d+)\.[0-9a-f]{4}-[\w-]+", ns)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        _kill(ns)
        _del(ns)
        swept.append(ns)
    return swept


def _ts(line: dict[str, Any]) -> float:
    """A JSON log line's time (structlog's ISO timestamp, local time) as Unix seconds."""
    return datetime.fromisoformat(line["timestamp"]).timestamp()


@dataclass
class Cluster:
    """loraflow on a :class:`Network`: broker, learner nodes and workers started by deploy/scripts."""

    procs: Processes
    root: Path
    model_dir: Path
    num_workers: int = 3
    learner_nodes: int = 2
    num_prompts: int = 400
    tokens_per_s: float = 200
    checkpoint_every: int = 3
    loopback: bool = False
    proxied: tuple[str, ...] = ()  # workers that reach the broker through a relay on their host (bench/netproxy.py)
    net: Network | None = None
    roles: dict[str, Proc] = field(default_factory=dict)  # role -> its newest process
    incarnations: Counter = field(default_factory=Counter)
    # made by setup(): each host's run dir (the learner nodes share one), the config, the CURVE key dirs
    run_dirs: dict[str, Path] = field(default_factory=dict, init=False)
    config: Path = field(init=False)
    broker_keys: Path = field(init=False)
    client_keys: dict[str, Path] = field(default_factory=dict, init=False)

    # -- layout ------------------------------------------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        return [f"w{i}" for i in range(1, self.num_workers + 1)]

    @property
    def nodes(self) -> list[str]:
        return [f"learner-{r}" for r in range(self.learner_nodes)]

    def host(self, role: str) -> str:
        """The host (namespace) a role runs on: its own, or the one shared host of a loopback run."""
        return "solo" if self.loopback else role

    def setup(self) -> Cluster:
        hosts = ["solo"] if self.loopback else ["broker", *self.nodes, *self.workers]
        self.net = Network(hosts).create()
        self.run_dirs = {h: self.root / "hosts" / h for h in ["broker", "learner", *self.workers]}
        for path in self.run_dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        self.config = write_config(
            self.root / "run.toml", run_dir=self.root / "unused", model_dir=self.model_dir, backend="sim",
            num_prompts=self.num_prompts, checkpoint_every=self.checkpoint_every, seed=17)
        text = self.config.read_text()
        assert "tokens_per_s = 200" in text, "tests/fault/system.write_config changed its [worker.sim] section"
        self.config.write_text(text.replace("tokens_per_s = 200", f"tokens_per_s = {self.tokens_per_s}"))
        self._make_keys()
        return self

    def _make_keys(self) -> None:
        keys = self.root / "keys"
        argv = [str(Path(sys.executable).parent / "loraflow"), "keys", str(keys), "--learner", "trainer"]
        for w in self.workers:
            argv += ["--worker", w]
        subprocess.run(argv, check=True, capture_output=True, timeout=60, env=child_env())
        # each client machine gets the broker's public key and its own key pair only
        for name in ["trainer", *self.workers]:
            own = self.root / "hosts" / f"keys-{name}"
            own.mkdir(parents=True, exist_ok=True)
            for f in ("broker.key", f"{name}.key_secret"):
                shutil.copy(keys / f, own / f)
            self.client_keys[name] = own
        self.broker_keys = keys

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{BROKER_PORT}" if self.loopback else f"tcp://broker:{BROKER_PORT}"

    def _env(self, **extra: str) -> dict[str, str]:
        return child_env(**{"LORAFLOW_VENV": str(Path(sys.executable).parent.parent), "LORAFLOW_CONFIG": str(self.config),
                            "LORAFLOW_ENDPOINT": self.endpoint, **extra})

    def _spawn(self, role: str, argv: list[str], env: dict[str, str], host: str | None = None) -> Proc:
        self.incarnations[role] += 1
        proc = self.procs.spawn(f"{role}.{self.incarnations[role]}", self.net.argv(self.host(host or role), argv),
                                env=env)
        self.roles[role] = proc
        return proc

    # -- starting ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.start_broker()
        for w in self.workers:
            self.start_worker(w)
        self.start_learner()

    def start_broker(self) -> None:
        endpoint_file = self.run_dirs["broker"] / "broker" / "endpoint"
        endpoint_file.unlink(missing_ok=True)
        bind = f"tcp://127.0.0.1:{BROKER_PORT}" if self.loopback else f"tcp://0.0.0.0:{BROKER_PORT}"
        proc = self._spawn("broker", [str(SCRIPTS / "broker.sh")], self._env(
            LORAFLOW_BIND=bind, LORAFLOW_RUN_DIR=str(self.run_dirs["broker"]), LORAFLOW_KEYS_DIR=str(self.broker_keys)))
        wait_for(lambda: endpoint_file.is_file() and endpoint_file.read_text().strip() or not proc.alive(), 60,
                 "the broker to bind", self.procs)
        assert proc.alive(), proc.log()[-3000:]

    def start_worker(self, w: str) -> None:
        endpoint = {}
        if w in self.proxied:
            self._start_relay(w)
            endpoint = {"LORAFLOW_ENDPOINT": f"tcp://127.0.0.1:{RELAY_PORT}"}
        # the worker id is <hostname>-<instance>: w2-1 (w2's loraflow-worker@1); in a loopback run solo-2
        self._spawn(w, [str(SCRIPTS / "worker.sh"), w[1:] if self.loopback else "1"], self._env(
            LORAFLOW_RUN_DIR=str(self.run_dirs[w]), LORAFLOW_KEYS_DIR=str(self.client_keys[w]), LORAFLOW_WORKER_KEY=w,
            **endpoint))

    def _start_relay(self, w: str) -> None:
        role = f"{w}-relay"
        if role in self.roles and self.roles[role].alive():
            return
        self.relay(w, delay_ms=0, reset=0)
        proc = self._spawn(role, [sys.executable, str(REPO / "bench" / "netproxy.py"), f"127.0.0.1:{RELAY_PORT}",
                                  self.endpoint.removeprefix("tcp://"), str(self._relay_control(w))], child_env(), host=w)
        wait_for(lambda: "listening" in proc.log() or not proc.alive(), 30, f"the relay on {w}", self.procs)
        assert proc.alive(), proc.log()

    def _relay_control(self, w: str) -> Path:
        return self.root / "hosts" / f"{w}-relay.json"

    def relay(self, w: str, **settings: float) -> None:
        """Change the relay's settings (``delay_ms``, ``reset``: see bench/netproxy.py); it reads them in 50 ms."""
        path = self._relay_control(w)
        current = json.loads(path.read_text()) if path.is_file() else {}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**current, **settings}))
        tmp.replace(path)

    def start_learner(self) -> None:
        for node in self.nodes:
            self.start_learner_node(node)

    def start_learner_node(self, node: str) -> None:
        rank = node.rsplit("-", 1)[1]
        rdzv = f"127.0.0.1:{RDZV_PORT}" if self.loopback else f"learner-0:{RDZV_PORT}"
        self._spawn(node, [str(SCRIPTS / "learner.sh")], self._env(
            LORAFLOW_RUN_DIR=str(self.run_dirs["learner"]), LORAFLOW_KEYS_DIR=str(self.client_keys["trainer"]),
            LORAFLOW_LEARNER_KEY="trainer", LORAFLOW_LEARNER_NNODES=str(self.learner_nodes),
            LORAFLOW_LEARNER_NODE_RANK=rank, LORAFLOW_RDZV_ENDPOINT=rdzv))

    # -- observing (files only: nothing outside the namespaces can reach the broker) ---------------------------

    @property
    def ledger_path(self) -> Path:
        return self.run_dirs["learner"] / "learner" / "ledger.jsonl"

    def ledger(self) -> list[dict[str, Any]]:
        return read_ledger(self.ledger_path) if self.ledger_path.is_file() else []

    def trained_ids(self, lines: list[dict[str, Any]] | None = None) -> set[str]:
        chain, _ = committed_chain(self.ledger() if lines is None else lines)
        return {g for step in chain for g in (*step["trained"], *step["zero_variance"])}

    def steps_since(self, t: float) -> list[dict[str, Any]]:
        return [x for x in self.ledger() if x["event"] == "step" and x["time_unix"] > t]

    def wait_steps(self, n: int, after: float, timeout_s: float, what: str) -> list[dict[str, Any]]:
        return wait_for(lambda: len(self.steps_since(after)) >= n and self.steps_since(after), timeout_s,
                        f"{n} learner steps after {what}", self.procs, interval_s=0.1)

    def role_logs(self, role: str) -> list[Path]:
        return sorted(self.root.glob(f"{role}.*.log"))

    def log_lines(self, role: str) -> list[dict[str, Any]]:
        return [x for p in self.role_logs(role) for x in read_json_lines(p) if "timestamp" in x]

    def accepted_after(self, w: str, t: float) -> float | None:
        """When the broker first accepted a group of worker ``w`` after ``t`` (the worker's ack; None: not yet)."""
        return min((_ts(x) for x in _accepted(self, w, t, float("inf"))), default=None)

    def event_after(self, role: str, event: str, t: float) -> float | None:
        """When ``role`` (a worker or a learner node) first logged ``event`` after ``t`` (None: not yet)."""
        return min((_ts(x) for x in self.log_lines(role) if x.get("event") == event and _ts(x) > t), default=None)

    def regenerated(self, t0: float, t1: float) -> dict[str, Any]:
        """Groups leased again in [t0, t1] after an earlier lease (generated twice), and the reasons the logs give:
        how many times each of the broker's lines about expiries, dead peers, drops and restores was logged (one
        line may cover several groups) and the workers' acks other than accepted, by status."""
        leases: list[tuple[float, str]] = sorted(
            (_ts(x), x["group_id"]) for w in self.workers for x in self.log_lines(w) if x.get("event") == "lease_granted")
        seen: set[str] = set()
        again = []
        for t, gid in leases:
            if gid in seen and t0 <= t <= t1:
                again.append(gid)
            seen.add(gid)
        why: Counter[str] = Counter()
        for x in self.log_lines("broker"):
            if t0 <= _ts(x) <= t1 and x.get("event") in ("lease_expired", "peer_dead", "peer_restarted",
                                                         "stale_groups_dropped", "withdrawn_groups_dropped",
                                                         "group_refused", "state_restored", "learner_restarted"):
                why[x["event"]] += 1
        for w in self.workers:
            for x in self.log_lines(w):
                if t0 <= _ts(x) <= t1 and x.get("event") == "group_acked" and x.get("status") != "accepted":
                    why[f"ack_{x.get('status')}"] += 1
        return {"groups": len(set(again)), "why": dict(why)}

    def audit_so_far(self) -> Audit:
        """The ledger part of the audit on a run still training: nothing trained twice, no withdrawn version."""
        lines = self.ledger()  # read once: a step committed between two reads would look lost
        return audit_learner(lines, self.trained_ids(lines))

    def throughput(self) -> float:
        """Groups trained per second in the committed history, from the first step to the last (start-up out)."""
        chain, _ = committed_chain(self.ledger())
        assert len(chain) >= 2, "a throughput needs two steps"
        return self.rate(chain[0]["time_unix"], chain[-1]["time_unix"])

    def rate(self, t0: float, t1: float) -> float:
        """Groups trained per second in the committed history between t0 and t1."""
        chain, _ = committed_chain(self.ledger())
        n = sum(len(s["trained"]) + len(s["zero_variance"]) for s in chain if t0 < s["time_unix"] <= t1)
        return n / max(t1 - t0, 1e-9)

    # -- stopping ----------------------------------------------------------------------------------------------

    def wait_all_trained(self, timeout_s: float) -> None:
        expected = {f"0:{i}" for i in range(self.num_prompts)}
        wait_for(lambda: self.trained_ids() >= expected, timeout_s, f"all {self.num_prompts} prompts trained",
                 self.procs, interval_s=0.2)

    def rank_pids(self) -> list[int]:
        """The learner's rank processes (torchrun's children, which carry RANK in their environment)."""
        pids = []
        for node in self.nodes:
            for pid in self.net.pids(self.host(node)):
                with contextlib.suppress(OSError):
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    if any(e.startswith(b"RANK=") for e in environ) and b"TORCHELASTIC_RUN_ID=loraflow-learner" in environ:
                        pids.append(pid)
        return sorted(set(pids))

    def stop(self) -> None:
        """Clean stop as systemd would do it, learner first (its final checkpoint needs the broker): SIGTERM to
        the ranks (torchrun's agent would turn its own SIGTERM into a failure), then workers, then the broker;
        every script must exit 0."""
        for pid in self.rank_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for node in self.nodes:
            proc = self.roles[node]
            wait_for(lambda proc=proc: not proc.alive(), 90, f"{node} to stop", self.procs)
            assert proc.popen.returncode == 0, f"{node} exited with {proc.popen.returncode}\n{proc.log()[-3000:]}"
        for role in [*self.workers, "broker"]:
            code = self.roles[role].stop(timeout_s=60)
            assert code == 0, f"{role} exited with {code}\n{self.roles[role].log()[-3000:]}"

    def audit(self) -> Audit:
        """tests/fault's audit over the stopped run: the learner's and the broker's state read from their hosts."""
        view = self.root / "audit-view"
        view.mkdir(exist_ok=True)
        for part, host in (("learner", "learner"), ("broker", "broker")):
            link = view / part
            if not link.exists():
                link.symlink_to(self.run_dirs[host] / part)
        worker_logs = [p for w in self.workers for p in self.role_logs(w)]
        return audit_run(view, worker_logs, self.num_prompts)

    def teardown(self) -> None:
        self.procs.cleanup()
        if self.net is not None:
            self.net.destroy()


# -- faults, each while the run trains; each returns what it measured ------------------------------------------

def remaining(c: Cluster) -> int:
    """Prompts of the epoch not yet in the committed history."""
    return c.num_prompts - len(c.trained_ids())


@contextlib.contextmanager
def _fault(c: Cluster, fault: str, steps: int = 2, same: list[str] | None = None) -> Iterator[None]:
    """A few steps of normal training first, with enough prompts left for the fault to land mid-run; after it,
    the roles in ``same`` (default: all) are the processes they were, and the ledger so far audits clean."""
    c.wait_steps(steps, time.time(), 90, f"training before the {fault}")
    left = remaining(c)
    assert left > 40, f"only {left} prompts left before the {fault}: give the run more prompts (Cluster.num_prompts)"
    before = {r: c.roles[r].pid for r in (list(c.roles) if same is None else same)}
    yield
    for role, pid in before.items():
        proc = c.roles[role]
        assert proc.pid == pid and proc.alive(), (
            f"{role} was restarted or died during the {fault} (it must reconnect by itself)\n{proc.log()[-3000:]}")
    c.audit_so_far()


def _wait_accepted(c: Cluster, w: str, t: float, what: str) -> float:
    return wait_for(lambda: c.accepted_after(w, t), 90, f"a group from {w} accepted after {what}", c.procs,
                    interval_s=0.1)


def worker_link_down(c: Cluster, w: str = "w1", down_s: float = 10.0) -> dict[str, Any]:
    """Pull the worker host's cable for ``down_s``: the others train on; after the restore the same worker process
    gets a group accepted again, and every lease it held was returned or finished."""
    with _fault(c, "worker link fault"):
        t_down = time.time()
        c.net.link(w, False)
        time.sleep(down_s)
        c.net.link(w, True)
        t_up = time.time()
        steps_during = len([s for s in c.steps_since(t_down) if s["time_unix"] <= t_up])
        t_back = _wait_accepted(c, w, t_up, "its link came back")
    held, returned, finished = _leases_across(c, w, t_down)
    assert held <= returned | finished, f"leases of {w} neither returned nor finished: {sorted(held - returned - finished)}"
    return {"fault": "worker_link_down", "host": w, "down_s": round(t_up - t_down, 2), "steps_while_down": steps_during,
            "restore_to_leased_s": _since(c.event_after(w, "lease_granted", t_up), t_up),
            "restore_to_accepted_s": round(t_back - t_up, 2),
            "leases_held": len(held), "leases_returned": len(held & returned), "leases_finished": len(held & finished),
            "regenerated": c.regenerated(t_down, t_back)}


def _leases_across(c: Cluster, w: str, t: float) -> tuple[set[str], set[str], set[str]]:
    """The groups ``w`` held at ``t`` (leased, no ack yet), those leased again later (returned to the queue) and
    those ``w`` itself got accepted later (finished)."""
    lines = c.log_lines(w)
    held = ({x["group_id"] for x in lines if x.get("event") == "lease_granted" and _ts(x) <= t}
            - {x["group_id"] for x in lines if x.get("event") == "group_acked" and _ts(x) <= t})
    returned = {x["group_id"] for v in c.workers for x in c.log_lines(v)
                if x.get("event") == "lease_granted" and _ts(x) > t and x["group_id"] in held}
    finished = {x["group_id"] for x in _accepted(c, w, t, float("inf")) if x["group_id"] in held}
    return held, returned, finished


def broker_link_down(c: Cluster, down_s: float = 10.0) -> dict[str, Any]:
    """Pull the broker host's cable: after the restore every worker and the learner carry on, same processes."""
    with _fault(c, "broker link fault"):
        t_down = time.time()
        c.net.link("broker", False)
        time.sleep(down_s)
        c.net.link("broker", True)
        t_up = time.time()
        # a step after the restore trained a batch that came over the restored link (a step takes < 1 s)
        step = c.wait_steps(1, t_up, 90, "the broker's link came back")[0]["time_unix"]
        accepted = {w: _wait_accepted(c, w, t_up, "the broker's link came back") for w in c.workers}
    t_back = max(step, *accepted.values())
    return {"fault": "broker_link_down", "down_s": round(t_up - t_down, 2),
            "restore_to_step_s": round(step - t_up, 2),
            "restore_to_leased_s": {w: _since(c.event_after(w, "lease_granted", t_up), t_up) for w in c.workers},
            "restore_to_accepted_s": {w: round(t - t_up, 2) for w, t in accepted.items()},
            "regenerated": c.regenerated(t_down, t_back)}


def broker_reboot(c: Cluster) -> dict[str, Any]:
    """Every process of the broker host SIGKILLed, the broker started again from its state dir; the learner and
    the workers reconnect by themselves."""
    with _fault(c, "broker reboot", same=[r for r in c.roles if r != "broker"]):
        t_kill = time.time()
        killed = c.net.kill_host("broker")
        c.roles["broker"].popen.wait(timeout=10)
        t_start = time.time()
        c.start_broker()
        t_bound = time.time()
        # the learner may finish a step of a batch it had before the kill: count from its new session
        rejoined = wait_for(lambda: c.event_after(c.nodes[0], "broker_reconnected", t_start), 90,
                            "the learner to reconnect to the restarted broker", c.procs, interval_s=0.1)
        step = c.wait_steps(1, rejoined, 120, "the broker restarted")[0]["time_unix"]
        accepted = {w: _wait_accepted(c, w, t_start, "the broker restarted") for w in c.workers}
        assert c.event_after("broker", "state_restored", t_start), \
            f"the restarted broker did not restore its state\n{c.roles['broker'].log()[-3000:]}"
    return {"fault": "broker_reboot", "processes_killed": len(killed), "restart_to_bound_s": round(t_bound - t_start, 2),
            "restart_to_learner_reconnected_s": round(rejoined - t_start, 2), "restart_to_step_s": round(step - t_start, 2),
            "restart_to_accepted_s": {w: round(t - t_start, 2) for w, t in accepted.items()},
            "regenerated": c.regenerated(t_kill, max(step, *accepted.values()))}


def learner_node_killed(c: Cluster, node: str = "learner-1", restart_after_s: float = 60.0) -> dict[str, Any]:
    """Every process of one learner node SIGKILLed: the other node's torchrun stops; the supervisor (systemd's
    Restart=, here this function) starts each node's learner.sh again, resuming from the newest checkpoint."""
    with _fault(c, "learner node kill", steps=c.checkpoint_every + 1, same=[]):
        starts_before = len([x for x in c.ledger() if x["event"] == "start"])
        t_kill = time.time()
        c.net.kill_host(node)
        c.roles[node].popen.wait(timeout=10)
        for other in [n for n in c.nodes if n != node]:
            wait_for(lambda other=other: not c.roles[other].alive(), restart_after_s,
                     f"torchrun on {other} to stop after {node} died", c.procs)
        codes = {n: c.roles[n].popen.returncode for n in c.nodes}
        t_start = time.time()
        c.start_learner()
        step = c.wait_steps(1, t_start, 180, f"the learner restarted after {node} was killed")[0]["time_unix"]
        starts = [x for x in c.ledger() if x["event"] == "start"]
        assert len(starts) == starts_before + 1, f"{len(starts) - starts_before} learner starts after the kill"
        resumed = starts[-1]
        assert resumed["step"] >= c.checkpoint_every, f"the learner resumed at step {resumed['step']}, not from a checkpoint"
    return {"fault": "learner_node_killed", "node": node, "exit_codes": codes,
            "kill_to_all_stopped_s": round(t_start - t_kill, 2), "restart_to_step_s": round(step - t_start, 2),
            "resumed_step": resumed["step"], "withdrawn": resumed["withdrawn"],
            "regenerated": c.regenerated(t_kill, step)}


PROBE_BYTES = 96 * 1024  # bandwidth_limited's link probe: ~0.7 s at 1 mbit, a few ms unlimited


def bandwidth_limited(c: Cluster, w: str = "w3", rate: str = "1mbit", hold_s: float = 10.0) -> dict[str, Any]:
    """A token bucket of ``rate`` on one worker's link (both ways) for ``hold_s``: it keeps submitting, slower.
    ``link_probe_s`` times a TCP transfer of ``PROBE_BYTES`` to the broker's host with the limit on and off (a
    sim group is smaller than the bucket's burst, so its ack time alone need not show the limit)."""
    with _fault(c, "bandwidth limit"):
        t0 = time.time()
        time.sleep(hold_s)
        t_limit = time.time()
        c.net.limit(w, rate)
        try:
            time.sleep(hold_s)
            t_free = time.time()  # the windows end here: the probes below do not share the link with them
            probe_s = {"limited": c.net.transfer_s(w, "broker", PROBE_BYTES)}
        finally:
            c.net.unlimit(w)
        probe_s["normal"] = c.net.transfer_s(w, "broker", PROBE_BYTES)
        normal, limited = _accepted(c, w, t0, t_limit), _accepted(c, w, t_limit, t_free)
        assert limited, f"no group of {w} accepted in {hold_s} s at {rate}"
    return {"fault": "bandwidth_limited", "host": w, "rate": rate,
            "groups_per_s": {"normal": round(len(normal) / (t_limit - t0), 2),
                             "limited": round(len(limited) / (t_free - t_limit), 2)},
            "median_ack_rtt_ms": {"normal": _median_rtt(normal), "limited": _median_rtt(limited)},
            "link_probe_s": {k: round(v, 3) for k, v in probe_s.items()}, "probe_bytes": PROBE_BYTES,
            "run_groups_per_s": {"normal": round(c.rate(t0, t_limit), 2), "limited": round(c.rate(t_limit, t_free), 2)},
            "regenerated": c.regenerated(t_limit, t_free)}


def _accepted(c: Cluster, w: str, t0: float, t1: float) -> list[dict[str, Any]]:
    return [x for x in c.log_lines(w) if x.get("event") == "group_acked" and x.get("status") == "accepted"
            and t0 < _ts(x) <= t1]


def _median_rtt(acks: list[dict[str, Any]]) -> float:
    """The median submit -> ack time of these acks (ms)."""
    return round(sorted(x["rtt_ms"] for x in acks)[len(acks) // 2], 1) if acks else float("nan")


def latency_and_resets(c: Cluster, w: str = "w2", delay_ms: float = 100, hold_s: float = 8.0,
                       resets: int = 2) -> dict[str, Any]:
    """Through the relay on ``w``'s host (bench/netproxy.py): ``delay_ms`` more each way for ``hold_s``, then
    ``resets`` times every connection cut; the same worker process gets groups accepted after each."""
    assert w in c.proxied, f"{w} does not connect through a relay (Cluster.proxied)"
    with _fault(c, "latency and connection resets"):
        t0 = time.time()
        time.sleep(hold_s)
        t_delay = time.time()
        c.relay(w, delay_ms=delay_ms)
        time.sleep(hold_s)
        c.relay(w, delay_ms=0)
        t_clear = time.time()
        normal, delayed = _accepted(c, w, t0, t_delay), _accepted(c, w, t_delay, t_clear)
        assert delayed, f"no group of {w} accepted in {hold_s} s with {delay_ms} ms more each way"
        recover = []
        for i in range(1, resets + 1):
            t_reset = time.time()
            c.relay(w, reset=i)
            recover.append(round(_wait_accepted(c, w, t_reset, f"reset {i}") - t_reset, 2))
    return {"fault": "latency_and_resets", "host": w, "delay_ms_each_way": delay_ms,
            "median_ack_rtt_ms": {"normal": _median_rtt(normal), "delayed": _median_rtt(delayed)},
            "reset_to_accepted_s": recover, "regenerated": c.regenerated(t_delay, time.time())}


FAULTS = {f.__name__: f for f in (worker_link_down, broker_link_down, broker_reboot, learner_node_killed,
                                  bandwidth_limited, latency_and_resets)}
