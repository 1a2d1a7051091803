"""A multi-host loraflow test bed in Linux network namespaces: on the hosts of bench/netns.py (:class:`Network`),
loraflow started by ``deploy/scripts`` as the systemd units start it, CURVE on (:class:`Cluster`), and
:data:`FAULTS`, measured from the files the roles write (the learner's ledger, the roles' JSON logs). Needs root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.netns import Network
from loraflow.learner.ledger import read as read_ledger
from tests.fault.ledger import Audit, audit_learner, audit_run, committed_chain, read_json_lines
from tests.fault.system import write_config
from tests.support import Proc, Processes, child_env, wait_for

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "deploy" / "scripts"
BROKER_PORT, RDZV_PORT, RELAY_PORT = 5555, 29500, 6555
PROBE_BYTES = 96 * 1024  # bandwidth_limited's link probe: ~0.7 s at 1 mbit, a few ms unlimited
def _ts(line: dict[str, Any]) -> float:  # structlog's ISO timestamp (local time) as Unix seconds
    return datetime.fromisoformat(line["timestamp"]).timestamp()


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def _first(lines: list[dict[str, Any]]) -> float | None:  # when the first of these lines was logged (None: none)
    return min((_ts(x) for x in lines), default=None)


@dataclass
class Cluster:
    """Broker, learner nodes (c10d on node 0, gloo) and workers on their hosts, or all on one if ``loopback``."""

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

    @property
    def workers(self) -> list[str]:
        return [f"w{i}" for i in range(1, self.num_workers + 1)]

    @property
    def nodes(self) -> list[str]:
        return [f"learner-{r}" for r in range(self.learner_nodes)]

    def host(self, role: str) -> str:  # the one host of a loopback run, else the role's own
        return "solo" if self.loopback else role

    def _host_port(self, host: str, port: int) -> str:
        return f"127.0.0.1:{port}" if self.loopback else f"{host}:{port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://{self._host_port('broker', BROKER_PORT)}"

    def _dir(self, name: str) -> Path:
        """A run dir (``broker``, ``learner``, a worker's), a client's key dir (``keys-<client>``), a relay's file."""
        return self.root / "hosts" / name

    def setup(self) -> Cluster:
        """The network, the run dirs, one config, and per client a key dir: the broker's public key, its own pair."""
        self.net = Network(["solo"] if self.loopback else ["broker", *self.nodes, *self.workers]).create()
        for name in ["broker", "learner", *self.workers]:
            self._dir(name).mkdir(parents=True, exist_ok=True)
        config = write_config(self.root / "run.toml", run_dir=self.root / "unused", model_dir=self.model_dir,
                              backend="sim", num_prompts=self.num_prompts, checkpoint_every=self.checkpoint_every, seed=17)
        text = config.read_text()
        assert "tokens_per_s = 200" in text, "tests/fault/system.write_config changed its [worker.sim] section"
        config.write_text(text.replace("tokens_per_s = 200", f"tokens_per_s = {self.tokens_per_s}"))
        subprocess.run([str(Path(sys.executable).parent / "loraflow"), "keys", str(self.root / "keys"), "--learner",
                        "trainer", *(arg for w in self.workers for arg in ("--worker", w))],
                       check=True, capture_output=True, timeout=60, env=child_env())
        for name in ["trainer", *self.workers]:
            self._dir(f"keys-{name}").mkdir(parents=True, exist_ok=True)
            for f in ("broker.key", f"{name}.key_secret"):
                shutil.copy(self.root / "keys" / f, self._dir(f"keys-{name}") / f)
        return self

    def _spawn(self, role: str, argv: list[str], host: str | None = None, **env: str) -> Proc:
        self.incarnations[role] += 1
        env = child_env(**{"LORAFLOW_VENV": str(Path(sys.executable).parent.parent), "LORAFLOW_ENDPOINT": self.endpoint,
                           "LORAFLOW_CONFIG": str(self.root / "run.toml"), **env})
        self.roles[role] = self.procs.spawn(f"{role}.{self.incarnations[role]}",
                                            self.net.argv(self.host(host or role), argv), env=env)
        return self.roles[role]

    def start(self) -> None:
        self.start_broker()
        for w in self.workers:
            self._start_worker(w)
        self.start_learner()

    def start_broker(self) -> None:
        endpoint_file = self._dir("broker") / "broker" / "endpoint"
        endpoint_file.unlink(missing_ok=True)
        proc = self._spawn("broker", [str(SCRIPTS / "broker.sh")], LORAFLOW_RUN_DIR=str(self._dir("broker")),
                           LORAFLOW_BIND=f"tcp://{self._host_port('0.0.0.0', BROKER_PORT)}",
                           LORAFLOW_KEYS_DIR=str(self.root / "keys"))
        wait_for(lambda: endpoint_file.is_file() and endpoint_file.read_text().strip() or not proc.alive(), 60,
                 "the broker to bind", self.procs)
        assert proc.alive(), proc.log()[-3000:]

    def _start_worker(self, w: str) -> None:
        """Worker ids are <hostname>-<instance>: w2-1, or solo-2 in a loopback run. A proxied one dials its relay."""
        endpoint = f"tcp://127.0.0.1:{RELAY_PORT}" if w in self.proxied else self.endpoint
        if w in self.proxied:
            relay = self._spawn(f"{w}-relay", [sys.executable, str(REPO / "bench" / "netproxy.py"), f"127.0.0.1:{RELAY_PORT}",
                                               self.endpoint.removeprefix("tcp://"), str(self.relay(w, delay_ms=0, reset=0))], host=w)
            wait_for(lambda: "listening" in relay.log() or not relay.alive(), 30, f"the relay on {w}", self.procs)
            assert relay.alive(), relay.log()
        self._spawn(w, [str(SCRIPTS / "worker.sh"), w[1:] if self.loopback else "1"], LORAFLOW_ENDPOINT=endpoint,
                    LORAFLOW_RUN_DIR=str(self._dir(w)), LORAFLOW_KEYS_DIR=str(self._dir(f"keys-{w}")),
                    LORAFLOW_WORKER_KEY=w)

    def relay(self, w: str, **settings: float) -> Path:
        """Change the relay's settings (``delay_ms``, ``reset``: bench/netproxy.py, read every 50 ms); its file."""
        path, tmp = self._dir(f"{w}-relay.json"), self._dir(f"{w}-relay.tmp")
        tmp.write_text(json.dumps({**(json.loads(path.read_text()) if path.is_file() else {}), **settings}))
        return tmp.replace(path)

    def start_learner(self) -> None:
        for rank, node in enumerate(self.nodes):
            self._spawn(node, [str(SCRIPTS / "learner.sh")], LORAFLOW_RUN_DIR=str(self._dir("learner")),
                        LORAFLOW_KEYS_DIR=str(self._dir("keys-trainer")), LORAFLOW_LEARNER_KEY="trainer",
                        LORAFLOW_LEARNER_NNODES=str(self.learner_nodes), LORAFLOW_LEARNER_NODE_RANK=str(rank),
                        LORAFLOW_RDZV_ENDPOINT=self._host_port("learner-0", RDZV_PORT))

    def ledger(self) -> list[dict[str, Any]]:
        """The learner's ledger (the roles are observed through their files only: nothing outside reaches them)."""
        path = self._dir("learner") / "learner" / "ledger.jsonl"
        return read_ledger(path) if path.is_file() else []

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

    def events(self, role: str, event: str | None = None, t0: float = -float("inf"),
               t1: float = float("inf")) -> list[dict[str, Any]]:
        """``role``'s JSON log lines (of ``event``, if given) logged in (t0, t1]."""
        return [x for p in self.role_logs(role) for x in read_json_lines(p)
                if "timestamp" in x and event in (None, x.get("event")) and t0 < _ts(x) <= t1]

    def accepted(self, w: str, t0: float, t1: float = float("inf")) -> list[dict[str, Any]]:
        """Worker ``w``'s acks, logged in (t0, t1], of groups the broker accepted."""
        return [x for x in self.events(w, "group_acked", t0, t1) if x.get("status") == "accepted"]

    def wait_accepted(self, w: str, t: float, what: str) -> float:
        return wait_for(lambda: _first(self.accepted(w, t)), 90, f"a group from {w} accepted after {what}",
                        self.procs, interval_s=0.1)

    def regenerated(self, t0: float, t1: float) -> dict[str, Any]:
        """Groups leased again in [t0, t1] (generated twice), and why: the broker's lines, workers' acks by status."""
        leases = sorted((_ts(x), x["group_id"]) for w in self.workers for x in self.events(w, "lease_granted"))
        first = {gid: t for t, gid in reversed(leases)}
        again = {gid for t, gid in leases if t0 <= t <= t1 and t > first[gid]}
        why = Counter(x["event"] for x in self.events("broker") if t0 <= _ts(x) <= t1 and x.get("event") in (
            "lease_expired", "peer_dead", "peer_restarted", "stale_groups_dropped", "withdrawn_groups_dropped",
            "group_refused", "state_restored", "learner_restarted"))
        why.update(f"ack_{x.get('status')}" for w in self.workers for x in self.events(w, "group_acked")
                   if t0 <= _ts(x) <= t1 and x.get("status") != "accepted")
        return {"groups": len(again), "why": dict(why)}

    def rate(self, t0: float | None = None, t1: float | None = None) -> float:
        """Groups trained per second in the committed history in (t0, t1], by default its first step to its last."""
        chain, _ = committed_chain(self.ledger())
        if t0 is None or t1 is None:
            assert len(chain) >= 2, "a throughput needs two steps"
            t0, t1 = chain[0]["time_unix"], chain[-1]["time_unix"]
        n = sum(len(s["trained"]) + len(s["zero_variance"]) for s in chain if t0 < s["time_unix"] <= t1)
        return n / max(t1 - t0, 1e-9)

    def wait_all_trained(self, timeout_s: float) -> None:
        wait_for(lambda: self.trained_ids() >= {f"0:{i}" for i in range(self.num_prompts)}, timeout_s, f"all {self.num_prompts} prompts trained",
                 self.procs, interval_s=0.2)

    def stop(self) -> None:
        """As systemd stops it, each script exiting 0: learner first (its last checkpoint needs the broker), SIGTERM
        to its ranks (torchrun's agent would make its own SIGTERM a failure), then workers, then the broker."""
        for pid in sorted({pid for node in self.nodes for pid in self.net.pids(self.host(node))}):
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if any(e.startswith(b"RANK=") for e in environ) and b"TORCHELASTIC_RUN_ID=loraflow-learner" in environ:
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
        for part in ("learner", "broker"):
            if not (view / part).exists():
                (view / part).symlink_to(self._dir(part) / part)
        return audit_run(view, [p for w in self.workers for p in self.role_logs(w)], self.num_prompts)

    def teardown(self) -> None:
        self.procs.cleanup()
        if self.net is not None:
            self.net.destroy()


# -- faults, each while the run trains; each returns what it measured ------------------------------------------

def remaining(c: Cluster) -> int:
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
    lines = c.ledger()  # read once: a step committed between two reads would look lost
    audit_learner(lines, c.trained_ids(lines))  # nothing trained twice, no withdrawn version


def _median_rtt(acks: list[dict[str, Any]]) -> float:
    return round(sorted(x["rtt_ms"] for x in acks)[len(acks) // 2], 1) if acks else float("nan")


def worker_link_down(c: Cluster, w: str = "w1", down_s: float = 10.0) -> dict[str, Any]:
    """The worker host's cable out for ``down_s``: the others train on, then it does; its leases return or finish."""
    with _fault(c, "worker link fault"):
        t_down, t_up = c.net.unplug(w, down_s)
        steps_during = len([s for s in c.steps_since(t_down) if s["time_unix"] <= t_up])
        t_back = c.wait_accepted(w, t_up, "its link came back")
    held = ({x["group_id"] for x in c.events(w, "lease_granted", t1=t_down)}
            - {x["group_id"] for x in c.events(w, "group_acked", t1=t_down)})
    returned = held & {x["group_id"] for v in c.workers for x in c.events(v, "lease_granted", t_down)}
    finished = held & {x["group_id"] for x in c.accepted(w, t_down)}
    assert held <= returned | finished, f"leases of {w} neither returned nor finished: {sorted(held - returned - finished)}"
    return {"fault": "worker_link_down", "host": w, "down_s": _since(t_up, t_down), "steps_while_down": steps_during,
            "restore_to_leased_s": _since(_first(c.events(w, "lease_granted", t_up)), t_up),
            "restore_to_accepted_s": _since(t_back, t_up), "leases_held": len(held), "leases_returned": len(returned),
            "leases_finished": len(finished), "regenerated": c.regenerated(t_down, t_back)}


def broker_link_down(c: Cluster, down_s: float = 10.0) -> dict[str, Any]:
    """The broker host's cable out: after it every worker and the learner carry on, the same processes."""
    with _fault(c, "broker link fault"):
        t_down, t_up = c.net.unplug("broker", down_s)
        # a step after the restore trained a batch that came over the restored link (a step takes < 1 s)
        step = c.wait_steps(1, t_up, 90, "the broker's link came back")[0]["time_unix"]
        accepted = {w: c.wait_accepted(w, t_up, "the broker's link came back") for w in c.workers}
    return {"fault": "broker_link_down", "down_s": _since(t_up, t_down), "restore_to_step_s": _since(step, t_up),
            "restore_to_leased_s": {w: _since(_first(c.events(w, "lease_granted", t_up)), t_up) for w in c.workers},
            "restore_to_accepted_s": {w: _since(t, t_up) for w, t in accepted.items()},
            "regenerated": c.regenerated(t_down, max(step, *accepted.values()))}


def broker_reboot(c: Cluster) -> dict[str, Any]:
    """Every process of the broker host SIGKILLed, the broker started again from its state dir; the rest reconnect."""
    with _fault(c, "broker reboot", same=[r for r in c.roles if r != "broker"]):
        t_kill = time.time()
        killed = c.net.kill_host("broker")
        c.roles["broker"].popen.wait(timeout=10)
        t_start = time.time()
        c.start_broker()
        t_bound = time.time()
        # the learner may finish a step of a batch it had before the kill: count from its new session
        rejoined = wait_for(lambda: _first(c.events(c.nodes[0], "broker_reconnected", t_start)), 90,
                            "the learner to reconnect to the restarted broker", c.procs, interval_s=0.1)
        step = c.wait_steps(1, rejoined, 120, "the broker restarted")[0]["time_unix"]
        accepted = {w: c.wait_accepted(w, t_start, "the broker restarted") for w in c.workers}
        restored = c.events("broker", "state_restored", t_start)
        assert restored, f"the restarted broker did not restore its state\n{c.roles['broker'].log()[-3000:]}"
    return {"fault": "broker_reboot", "processes_killed": len(killed), "restart_to_bound_s": _since(t_bound, t_start),
            "restart_to_learner_reconnected_s": _since(rejoined, t_start), "restart_to_step_s": _since(step, t_start),
            "restart_to_accepted_s": {w: _since(t, t_start) for w, t in accepted.items()},
            "regenerated": c.regenerated(t_kill, max(step, *accepted.values()))}


def learner_node_killed(c: Cluster, node: str = "learner-1", restart_after_s: float = 60.0) -> dict[str, Any]:
    """One learner node's processes SIGKILLed; the others' torchrun stops, and as systemd's Restart= would, this
    starts every node's learner.sh again, resuming from the newest checkpoint."""
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
            "kill_to_all_stopped_s": _since(t_start, t_kill), "restart_to_step_s": _since(step, t_start),
            "resumed_step": resumed["step"], "withdrawn": resumed["withdrawn"], "regenerated": c.regenerated(t_kill, step)}


def bandwidth_limited(c: Cluster, w: str = "w3", rate: str = "1mbit", hold_s: float = 10.0) -> dict[str, Any]:
    """A token bucket of ``rate`` on one worker's link (both ways) for ``hold_s``: it keeps submitting, slower.
    ``link_probe_s``: a TCP transfer with the limit on and off (a sim group fits in the bucket's burst)."""
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
            c.net.limit(w, None)
        probe_s["normal"] = c.net.transfer_s(w, "broker", PROBE_BYTES)
        normal, limited = c.accepted(w, t0, t_limit), c.accepted(w, t_limit, t_free)
        assert limited, f"no group of {w} accepted in {hold_s} s at {rate}"
    return {"fault": "bandwidth_limited", "host": w, "rate": rate,
            "groups_per_s": {"normal": round(len(normal) / (t_limit - t0), 2),
                             "limited": round(len(limited) / (t_free - t_limit), 2)},
            "median_ack_rtt_ms": {"normal": _median_rtt(normal), "limited": _median_rtt(limited)},
            "link_probe_s": {k: round(v, 3) for k, v in probe_s.items()}, "probe_bytes": PROBE_BYTES,
            "run_groups_per_s": {"normal": round(c.rate(t0, t_limit), 2), "limited": round(c.rate(t_limit, t_free), 2)},
            "regenerated": c.regenerated(t_limit, t_free)}


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
        normal, delayed = c.accepted(w, t0, t_delay), c.accepted(w, t_delay, t_clear)
        assert delayed, f"no group of {w} accepted in {hold_s} s with {delay_ms} ms more each way"
        recover = []
        for i in range(1, resets + 1):
            t_reset = time.time()
            c.relay(w, reset=i)
            recover.append(_since(c.wait_accepted(w, t_reset, f"reset {i}"), t_reset))
    return {"fault": "latency_and_resets", "host": w, "delay_ms_each_way": delay_ms,
            "median_ack_rtt_ms": {"normal": _median_rtt(normal), "delayed": _median_rtt(delayed)},
            "reset_to_accepted_s": recover, "regenerated": c.regenerated(t_delay, time.time())}


FAULTS = {f.__name__: f for f in (worker_link_down, broker_link_down, broker_reboot, learner_node_killed,
                                  bandwidth_limited, latency_and_resets)}
