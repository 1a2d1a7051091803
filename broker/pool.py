"""The broker's runs: one :class:`BrokerCore` per run, and which run each connection joined.

A pool broker serves several runs on one base model at once (:mod:`loraflow.common.pool_runs`). Each run has a
core of its own, so its ledger, prompt source, adapter lineage, leases, learner, run token and state file are
its own; nothing of one run is reachable from another run's messages::

    connection (zmq identity) --Hello(run=R)--> cores[R]    every later message of that connection: cores[R]
    StatsRequest(run=R) from any connection  --> cores[R]
    a Hello naming a run the pool does not hold: Error ``unknown_run`` (the connection stays unjoined)
    a Hello naming another run than the one the connection joined: Error ``forbidden`` (a run per connection)

The broker's own run (``run=""``, the config it was started with) is always there: a broker started for one run
is a pool of one, and its clients never name a run. Submitted runs are found on disk: every ``RUN_SCAN_S`` the
pool lists ``<run_dir>/runs/``; a run directory with a ``submitted.toml`` gets a core (restored from its state
file, so a restarted broker continues every run where it stopped), one whose settings the pool refuses gets a
``refused`` file saying why, and a ``cancelled`` file stops that run's leasing (its parked requests are answered
``draining``; what is buffered can still be trained and acknowledged).

Tenants (``loraflow submit/cancel --endpoint``, CURVE on): a RunSubmit writes the run into the runs directory
as ``loraflow submit --pool`` does, with the observer key that sent it as the run's ``owner``; a RunCancel or a
StatsRequest from an observer key naming a run is answered only for the run's owner or the pool's own observer
key (``observer:observer``): a tenant submits, watches and cancels its own runs and no other's (worker and
learner keys are the pool's own processes, not tenants). Without CURVE there
is no key to own a run, so the network control plane is refused (the pool's machine submits through the
directory).

The socket-level counters (connections, CURVE handshakes) and the loop's times are the broker's own run's.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraflow.broker.core import BrokerCore
from loraflow.broker.dispatch import peek_kind
from loraflow.broker.outbox import Outgoing
from loraflow.common import codec, pool_runs
from loraflow.common.codes import ProtocolError
from loraflow.common.config import ConfigError
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Kind, RunReply, RunSubmit
from loraflow.common.security import OBSERVER_KEY

log = get_logger("broker")

RUN_SCAN_S = 1.0  # how often the runs directory is listed for submitted and cancelled runs
FORGET_S = 30.0  # how often connections whose peer every core has forgotten are dropped from the routing map
NAMED_KINDS = (Kind.HELLO, Kind.STATS_REQUEST)  # the messages that say which run they are for
CONTROL_KINDS = (Kind.RUN_SUBMIT, Kind.RUN_CANCEL)  # the tenants' control plane, answered by the pool itself
ADMIN_KEY = f"observer:{OBSERVER_KEY}"  # the pool's own observer key: watches and cancels every run


class BrokerPool:
    """Routes each message to its run's core and gathers what every core sends."""

    def __init__(self, default: BrokerCore, *, make_core: Callable[[str], BrokerCore] | None = None,
                 runs_dir: Path | None = None) -> None:
        self.default = default
        self.cores: dict[str, BrokerCore] = {"": default}
        self.cancelled: set[str] = set()
        self.refused: dict[str, str] = {}
        self._make_core = make_core
        self._runs_dir = runs_dir
        self._run_of: dict[bytes, str] = {}  # a connection -> the run it joined
        self._sender: dict[int, BrokerCore] = {}  # id(Outgoing) -> its core, for send_failed (one flush's worth)
        self._next_scan_s = 0.0
        self._next_forget_s = 0.0
        self.on_durable: Callable[[], None] | None = None
        self.handled_kind = ""

    # what the server reads of the broker's own run
    @property
    def stats(self) -> Any:
        return self.default.stats

    @property
    def loop_times(self) -> Any:
        return self.default.loop_times

    def set_on_durable(self, wake: Callable[[], None]) -> None:
        """Every core's state writer signals ``wake`` when a write is durable (cores added later too)."""
        self.on_durable = wake
        for core in self.cores.values():
            if core.writer is not None:
                core.writer.on_durable = wake

    # -- receiving -------------------------------------------------------------------------------------------

    def handle(self, identity: bytes, frames: list[Any], now_s: float, authenticated_role: str | None = None,
               authenticated_key: str | None = None) -> None:
        joined = self._run_of.get(identity)
        run = joined or ""
        kind = peek_kind(frames)
        if kind in CONTROL_KINDS:
            self._control(identity, frames, kind, authenticated_role, authenticated_key, now_s)
            return
        if kind in NAMED_KINDS:
            run = self._named_run(frames, default=run)
        if kind == Kind.STATS_REQUEST and authenticated_role == "observer" and not self._owns(authenticated_key, run):
            self._refuse(identity, kind, "forbidden", f"run {run!r} is another tenant's: a key watches the runs "
                         "it submitted")
            return
        core = self.cores.get(run)
        if core is None:
            self._refuse(identity, kind, "unknown_run", f"this broker holds no run {run!r} (loraflow runs lists "
                         f"them; a run is added by loraflow submit)")
            return
        if kind == Kind.HELLO:
            if joined is not None and joined != run:
                self._refuse(identity, kind, "forbidden", f"this connection joined run {joined!r}; a client joins "
                             f"another run on a connection of its own")
                return
            if run:
                self._run_of[identity] = run
        core.handle(identity, frames, now_s, authenticated_role=authenticated_role, authenticated_key=authenticated_key)
        self.handled_kind = core.handled_kind

    def _named_run(self, frames: list[Any], *, default: str) -> str:
        """The run a Hello or StatsRequest names; ``default`` when it does not decode (its core answers that)."""
        try:
            record = codec.decode_envelope(frames, self.default.config.broker.max_message_bytes).record
        except ProtocolError:
            return default
        return getattr(record, "run", default) if record is not None else default

    # -- the tenants' control plane (see the module docstring) ------------------------------------------------

    def _owns(self, key: str | None, run: str) -> bool:
        """Whether the observer (tenant) key ``key`` may watch or cancel ``run``: its owner and the pool's own key
        (a run put in the directory on the pool's machine has no owner: the pool's key only). The pool's own run
        ("") is every key's to watch, as for a broker of one run; worker and learner keys are the pool's own
        processes and are not tenants."""
        if not run or key == ADMIN_KEY:
            return True
        return bool(key) and pool_runs.owner_of(self.default.config, run) == key

    def _control(self, identity: bytes, frames: list[Any], kind: int, role: str | None, key: str | None,
                 now_s: float) -> None:
        if self._runs_dir is None:
            return self._refuse(identity, kind, "forbidden", "this broker serves one run (broker.pool = false)")
        if role != "observer":
            return self._refuse(identity, kind, "forbidden", "runs are submitted and cancelled over the network "
                                "with a tenant's observer key and CURVE on (security.enabled; loraflow keys DIR "
                                "--observer NAME); on the pool's machine: loraflow submit --pool DIR"
                                if role is None else f"a {role} key may not submit or cancel runs")
        try:
            record = codec.decode_envelope(frames, self.default.config.broker.max_message_bytes).record
        except ProtocolError as exc:
            return self._refuse(identity, kind, exc.code, str(exc))
        pool = self.default.config
        try:
            if isinstance(record, RunSubmit):
                settings = _toml(record.settings)
                pool_runs.check_tenant_code(pool, settings)
                pool_runs.check_tenant_data(pool, settings)
                run_id = pool_runs.submit(pool, settings, record.run, owner=key or "")
                state = "submitted"
                log.info("run_submitted", run=run_id, owner=key)
                self.scan(now_s)
            else:
                run_id = record.run
                if run_id not in self.cores and run_id not in self.refused:
                    return self._refuse(identity, kind, "unknown_run", f"this pool holds no run {run_id!r}")
                if not self._owns(key, run_id):
                    return self._refuse(identity, kind, "forbidden", f"run {run_id!r} is another tenant's: a key "
                                        "cancels the runs it submitted")
                pool_runs.cancel(pool, run_id, record.reason)
                state = "cancelling"
                self.scan(now_s)
        except ConfigError as exc:
            return self._refuse(identity, kind, "invalid_run", str(exc))
        self.default.stats.count("messages_in", "run_submit" if isinstance(record, RunSubmit) else "run_cancel")
        self.default.outbox.send_record(identity, RunReply(run=run_id, state=state))
        self.handled_kind = "run_control"

    def _refuse(self, identity: bytes, kind: int, code: str, message: str) -> None:
        self.default.stats.count("messages_in", "refused_run")
        self.default.outbox.reject(identity, code, message, ref_kind=kind)
        self.handled_kind = "refused_run"

    def _core_of(self, identity: bytes) -> BrokerCore:
        return self.cores.get(self._run_of.get(identity, ""), self.default)

    def internal_error(self, identity: bytes, frames: list[Any]) -> None:
        self._core_of(identity).internal_error(identity, frames)

    def send_failed(self, out: Outgoing, reason: str) -> None:
        self._sender.get(id(out), self._core_of(out.identity)).send_failed(out, reason)

    # -- timers and sending ----------------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        if self._runs_dir is not None and now_s >= self._next_scan_s:
            self._next_scan_s = now_s + RUN_SCAN_S
            self.scan(now_s)
        if now_s >= self._next_forget_s:
            self._next_forget_s = now_s + FORGET_S
            self._run_of = {identity: run for identity, run in self._run_of.items()
                            if run in self.cores and self.cores[run].peers.get(identity) is not None}
        for core in self.cores.values():
            core.tick(now_s)

    def flush(self, now_s: float) -> list[Outgoing]:
        return self._gather(lambda core: core.flush(now_s))

    def drain(self, now_s: float) -> list[Outgoing]:
        return self._gather(lambda core: core.drain(now_s))

    def _gather(self, take: Callable[[BrokerCore], list[Outgoing]]) -> list[Outgoing]:
        if len(self.cores) == 1:
            self._sender.clear()
            return take(self.default)
        self._sender = {}
        outgoing: list[Outgoing] = []
        for core in self.cores.values():
            for out in take(core):
                self._sender[id(out)] = core
                outgoing.append(out)
        return outgoing

    def has_work(self, now_s: float) -> bool:
        return any(core.has_work(now_s) for core in self.cores.values())

    def next_wakeup_s(self, now_s: float) -> float:
        wakeups = [core.next_wakeup_s(now_s) for core in self.cores.values()]
        if self._runs_dir is not None:
            wakeups.append(self._next_scan_s)
        return min(wakeups)

    # -- the runs on disk ------------------------------------------------------------------------------------

    def scan(self, now_s: float) -> None:
        """Cores for newly submitted runs, refusals written for runs the pool cannot hold, cancels applied."""
        try:
            entries = sorted(p for p in self._runs_dir.iterdir() if p.is_dir())  # type: ignore[union-attr]
        except FileNotFoundError:
            return
        for directory in entries:
            run_id = directory.name
            if run_id not in self.cores and run_id not in self.refused and (directory / pool_runs.SUBMITTED).is_file():
                self._add(run_id, directory)
            core = self.cores.get(run_id)
            if core is not None and run_id not in self.cancelled and (directory / pool_runs.CANCELLED).exists():
                self.cancelled.add(run_id)
                core.stop_leasing(now_s)
                log.info("run_cancelled", run=run_id, reason=_text(directory / pool_runs.CANCELLED))

    def _add(self, run_id: str, directory: Path) -> None:
        refused = (directory / pool_runs.REFUSED)
        if refused.exists():
            self.refused[run_id] = _text(refused)
            return
        try:
            core = self._make_core(run_id)  # type: ignore[misc]
        except (ConfigError, ValueError, OSError) as exc:
            self.refused[run_id] = str(exc)
            refused.write_text(f"{exc}\n")
            log.warning("run_refused", run=run_id, why=str(exc))
            return
        if core.writer is not None and self.on_durable is not None:
            core.writer.on_durable = self.on_durable
        self.cores[run_id] = core
        log.info("run_added", run=run_id, task=core.config.run.task, latest_version=core.latest_version,
                 cursor=list(core.ledger.source.cursor))


def _toml(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the run's settings are not valid TOML: {exc}") from None


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()[:4000]
    except OSError:
        return ""
