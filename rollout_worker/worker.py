"""The worker loop: leases in, scored rollout groups out, adapters swapped between chunks.

    consumes   LeaseGrants (queued by the BrokerSession's dispatcher thread), the newest verified adapter (the
               session's one-adapter slot) and finished environment steps (guarded threads)
    produces   RolloutGroups (kept until acked), LeaseRequests, LeaseReturns when stopping
    blocks on  the backend: one chunk round, or one engine step of a streaming backend (vllm: its engine core
               keeps stepping meanwhile, so the engine never waits for this loop); with nothing ready, on the wake
               event, set by a grant, an adapter, an ack, an environment step or SIGTERM (timeout: the next step
               deadline)
    owns       the backend: no other thread touches the model

    loop:
        the adapter in the session's slot (the newest received) -> backend; older versions no sample under way
            needs are unloaded and their directories deleted
        granted leases -> new groups in Rollouts
        groups < worker.capacity -> keep one LeaseRequest outstanding (a long-poll at the broker)
        a sample ready or generating -> Rollouts.step (one chunk round / one engine step), else wait for the wake
            event
        finished groups -> submit (BrokerSession keeps them until acked, re-sends after a broker restart)

Joining a busy run: the session fetches only the newest adapter and holds at most one ahead of the backend
(see rollout_worker/client.py), so a worker joining a learner that publishes faster than it loads loads one
adapter per loop pass, each the newest it knows of, and generates between loads; the versions published in
between are never fetched. The backend owns "which version am I on" (``backend.newest_version``); the rollouts
read it, and the session is told after each load for the hello and heartbeats. One pass of the loop loads at
most one adapter and generates at most one chunk round, so a stop request is seen within about one of each.

Reward failures: a group whose every sample's reward (or environment) failed trains nothing. After
``worker.max_failed_reward_groups`` such groups in a row (0 = never) the worker logs ``reward_failing`` with
the reward function or environment and the last error, returns its leases (that group's too) and exits with
code 2, a config-class error that ``loraflow run`` and systemd do not restart.

Heartbeats run in BrokerLink's I/O thread, so a long chunk never looks like a dead worker; the loop only keeps
the reported state current (starting, idle, waiting, generating, scoring, stopping), mirrored into the run's
timeline (``timeline/worker-<id>.jsonl``), and the ids of the leases in progress, which the broker renews with every
beat: a group that takes longer than ``broker.lease_timeout_s`` is never handed out twice.

Withdrawn versions: when the learner restarts from an older checkpoint, the versions it published after that
checkpoint are withdrawn (see broker/history.py). Nothing special happens here: the broker grants no lease to a
worker still holding one (``stale_adapter``, so it fetches), refuses groups holding their tokens (dropped like any
refused group, the prompt re-queued), and the learner republishes under a new, higher version, which the worker
loads like any newer adapter.

SIGTERM (or SIGINT): stop leasing, return the leases of unfinished groups (LeaseReturn; the broker re-queues
them), wait up to ``STOP_ACK_WAIT_S`` for the acks of submitted groups, say Bye, exit 0. The process then ends
with ``os._exit`` after the atexit handlers (:func:`end_process`): tearing down an interpreter that holds torch
and transformers takes 1.5 s on an idle machine and 4 s on a busy one, and there is nothing left to release. After SIGKILL the broker
reclaims the leases itself (missed heartbeats, or a hello with a new session from the same worker id). A signal
while still connecting or loading the model (nothing leased yet) exits 0 at once.
"""

from __future__ import annotations

import atexit
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from loraflow.common.cli import EXIT_CONFIG_ERROR, EXIT_USER_CODE_STUCK, out_of_memory
from loraflow.common.config import Config
from loraflow.common.logging import bind, get_logger
from loraflow.common.metrics import Metrics, serve_prometheus
from loraflow.common.protocol import LeaseGrant
from loraflow.common.security import client_security
from loraflow.common.timeline import Timeline
from loraflow.common.transport import BrokerRefused, BrokerUnavailable
from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.backends import Backend, make_backend
from loraflow.rollout_worker.client import LEASE_WAIT_MS, BrokerSession
from loraflow.rollout_worker.envs import EnvResolver
from loraflow.rollout_worker.rewards import load_rewards
from loraflow.rollout_worker.rewards.guard import RunawayWatch
from loraflow.rollout_worker.rollout import Rollouts
from loraflow.rollout_worker.samples import FinishedGroup

log = get_logger("worker")

STOP_ACK_WAIT_S = 10.0
IDLE_WAIT_S = 0.5
EMPTY_GRANT_BACKOFF_S = 0.2


class StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT before the loop runs (connecting, loading the model): nothing is leased, so leave."""


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    """One rollout worker process (see the module docstring)."""

    def __init__(self, config: Config, *, worker_id: str, session: BrokerSession, backend: Backend,
                 store: AdapterStore, metrics: Metrics, wake: threading.Event, stop: threading.Event,
                 timeline: Timeline) -> None:
        self.config = config
        self.worker_id = worker_id
        self.session = session
        self.backend = backend
        self.store = store
        self.metrics = metrics
        self.wake = wake
        self.stop = stop
        self.timeline = timeline
        if config.worker.agent:  # an agent harness through the OpenAI-compatible gateway (rollout_worker/gateway)
            from loraflow.rollout_worker.gateway.episodes import AgentRollouts
            self.rollouts = AgentRollouts(config, backend, worker_id=worker_id, metrics=metrics, wake=wake,
                                          info_path=config.run_dir / "workers" / worker_id / "gateway.json")
        else:
            self.rollouts = Rollouts(backend, EnvResolver(config.worker.env), config.worker, worker_id=worker_id,
                                     max_seq_len=config.model.max_seq_len, metrics=metrics,
                                     rewards=load_rewards(config.worker), wake=wake)
        self._next_request_at = 0.0
        self._state = ""
        self._num_failed_groups = 0  # groups in a row whose every sample's reward failed
        self._fatal: tuple[int, str, dict[str, Any]] | None = None  # why it stops: exit code, event, fields
        self._runaway = RunawayWatch()  # user code abandoned at its timeout that keeps computing

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self, signals: list[str] | None = None) -> int:
        """Generate until ``stop`` is set; ``signals`` are the names of the signals that set it (for the log).
        Returns the exit code: 0, EXIT_CONFIG_ERROR when the reward fails on everything or the backend refuses an
        adapter, or EXIT_USER_CODE_STUCK when user code keeps computing past its timeout."""
        while not self.stop.is_set():
            self.wake.clear()
            self._load_adapter()
            self._start_granted()
            self._request_leases()
            if self.rollouts.has_ready():
                self._mark("generating")
                finished = self.rollouts.step()
            else:
                finished = self.rollouts.poll()
                if not finished:
                    self._mark("scoring" if self.rollouts.num_groups else
                               "waiting" if self.session.lease_request_pending else "idle")
                    self.wake.wait(self._wait_s())
            for i, group in enumerate(finished):
                if self._reward_failing(group):  # stop: this group and the rest go back unsubmitted
                    self.session.return_leases([g.group.lease_id for g in finished[i:]], "reward failing")
                    break
                # logged before sending: a worker's log is part of a run's ledger, and a kill between the two
                # must not hide a group the broker may have received
                log.info("group_submitted", group_id=group.group.group_id, min_version=group.group.min_version,
                         max_version=group.group.max_version, reward=round(sum(group.group.rewards)
                                                                           / group.group.num_samples, 3),
                         generate_s=round(group.group.generate_s, 3))
                self.session.submit(group)
            self._report()
            self._check_user_code()
        if signals:
            log.info("signal", signal=signals[0])
        self._shutdown()
        if self._fatal is not None:  # the last line of the log: what `loraflow run` shows of a child that exited
            code, event, fields = self._fatal
            log.error(event, **fields)
            return code
        return 0

    @property
    def fatal_error(self) -> str:
        """Why the loop stopped with a non-zero code ("" when it did not)."""
        return self._fatal[2].get("error", self._fatal[1]) if self._fatal else ""

    def _reward_failing(self, finished: FinishedGroup) -> bool:
        """Count groups in a row whose every sample failed; True (and ``stop`` set) at the limit."""
        group = finished.group
        if group.num_reward_failures < group.num_samples:
            self._num_failed_groups = 0
            return False
        self._num_failed_groups += 1
        limit = self.config.worker.max_failed_reward_groups
        if not limit or self._num_failed_groups < limit:
            return False
        worker = self.config.worker
        code = f"reward function {worker.reward}" if worker.reward else f"agent {worker.agent}" if worker.agent else \
            f"environment {type(self.rollouts.envs.for_task(group.task)).__qualname__} of task {group.task!r}"
        error = (f"every sample of {self._num_failed_groups} groups in a row failed its reward "
                 f"(worker.max_failed_reward_groups = {limit}): {code}; last error {self.rollouts.last_failure}")
        self._fatal = (EXIT_CONFIG_ERROR, "reward_failing", {
            "error": error, "fix": "fix the reward function or environment (worker.reward / worker.env), or raise "
                                   "worker.max_failed_reward_groups (0 = never stop)"})
        self.stop.set()  # the loop ends, the leases go back, then run() logs why and returns EXIT_CONFIG_ERROR
        return True

    def _check_user_code(self) -> None:
        """Stop for a restart when user code abandoned at its timeout keeps this process busy (rewards.guard): its
        thread holds the GIL the engine needs, and only a new process is rid of it."""
        stuck = self._runaway.check()
        if not stuck:
            return
        worker = self.config.worker
        code = f"reward function(s) {worker.rewards or worker.reward}" if worker.rewards or worker.reward else \
            f"agent {worker.agent}" if worker.agent else "the environment of the task"
        self.metrics.inc("user_code_stuck", len(stuck))
        self._fatal = (EXIT_USER_CODE_STUCK, "user_code_stuck", {
            "calls": [f"{c.name}: {c.cpu_share:.0%} of this process's CPU, {c.past_deadline_s:g} s past its "
                      "deadline" for c in stuck],
            "error": f"{code} ran past worker.reward_timeout_s and kept computing; Python cannot stop a thread, and "
                     "while it runs it holds the interpreter lock the engine needs (hf generation ran ~200x slower), so "
                     "this worker restarts",
            "fix": "bound the function's work (e.g. a timeout inside it for a solver or regex that can run away)"})
        self.stop.set()

    def _wait_s(self) -> float:
        """How long to wait for the wake event: until the next step deadline or lease request, at most idle."""
        now = time.monotonic()
        wake_at = [now + IDLE_WAIT_S, self.rollouts.next_deadline() or math.inf]
        if self._next_request_at > now:
            wake_at.append(self._next_request_at)
        return max(0.0, min(wake_at) - now)

    def _load_adapter(self) -> None:
        """Load the newest adapter received, if one is waiting; unload and delete what nothing needs any more."""
        adapter = self.session.take_adapter()
        if adapter is None:
            return
        started = time.monotonic()
        try:
            self.backend.add_adapter(adapter)
        except Exception as exc:  # a verified adapter the engine refuses would be refused again after a restart
            # (hf and our own checks raise ValueError; vLLM's engine core a bare Exception, "Call to add_lora failed")
            if out_of_memory(exc):
                raise  # not the adapter's fault: run_main's out-of-memory line naming the settings, exit code 3
            self.metrics.inc("adapters_rejected", reason="load")
            self._fatal = (EXIT_CONFIG_ERROR, "adapter_refused", {
                "version": adapter.version, "error": f"the {self.backend.name} backend refused adapter "
                f"v{adapter.version}: {exc}", "fix": "run the learner and every worker with the same model.path "
                "and learner.lora_rank"})
            self.session.discard_adapter(adapter)
            self.stop.set()  # exit 2: a restart would fetch the same adapter (stale_adapter until then)
            return
        served = self.backend.served(adapter.version)
        load_ms = round((time.monotonic() - started) * 1000, 1)
        if served.sha256 != adapter.sha256:  # the learner refuses its groups (adapter_sha256): say why here too
            self.metrics.inc("adapters_served_mismatch")
            log.warning("adapter_served_mismatch", version=adapter.version, published=adapter.sha256[:12],
                        loaded=served.sha256[:12], hint="the adapter file changed on disk before the engine read it")
        newest = self.backend.newest_version
        self.session.set_adapter_version(newest)
        self._next_request_at = 0.0  # a stale_adapter back-off waited for this adapter: ask with it at once
        bind(version=newest)
        keep = {newest} | self.rollouts.versions_in_use()  # older versions: only samples pinned to them
        self.backend.retain(keep)
        log.info("adapter_loaded", version=adapter.version, load_ms=load_ms, num_bytes=adapter.num_bytes,
                 lora_id=served.lora_id, phases_ms=self.backend.load_phases_ms or None,
                 resident=sorted(keep))  # older ones: turns that keep their version
        self.store.prune(keep, upto_version=newest)

    def _start_granted(self) -> None:
        while True:
            try:
                grant: LeaseGrant = self.session.grants.get_nowait()
            except queue.Empty:
                return
            if not grant.leases:
                self.metrics.inc("empty_grants", reason=grant.reason or "none")
                if not self._may_ask_again_now(grant):
                    self._next_request_at = time.monotonic() + EMPTY_GRANT_BACKOFF_S
                continue
            if self.stop.is_set():
                self.session.return_leases([lease.lease_id for lease in grant.leases], "worker stopping")
                continue
            for lease in grant.leases:
                self.rollouts.add(lease)
                self.metrics.inc("leases_granted")
                log.info("lease_granted", group_id=lease.group_id, lease_id=lease.lease_id,
                         group_size=lease.group_size)
            self._report()  # the next heartbeat already renews them, not only after the first chunk round

    def _may_ask_again_now(self, grant: LeaseGrant) -> bool:
        """An empty grant that needs no back-off: a long-poll that timed out (``backpressure``: it already waited
        in the broker), or ``stale_adapter`` answered to a request made just before the newest adapter arrived
        (the next request carries that version, so it cannot be refused for it again)."""
        if grant.reason == "backpressure":
            return True
        return grant.reason == "stale_adapter" and self.backend.newest_version >= grant.latest_version

    def _request_leases(self) -> None:
        free = self.config.worker.capacity - self.rollouts.num_groups
        if free <= 0 or self.session.lease_request_pending or time.monotonic() < self._next_request_at:
            return
        self.session.request_leases(free, self.backend.newest_version, wait_ms=LEASE_WAIT_MS)

    def _mark(self, state: str) -> None:
        if state != self._state:
            self._state = state
            self.timeline.mark(state)
            self.session.link.set_state(state, num_leases=self.rollouts.num_groups)

    def _report(self) -> None:
        m = self.metrics
        self.session.link.set_state(num_leases=self.rollouts.num_groups, lease_ids=list(self.rollouts.groups),
                                    groups_submitted=int(m.total("groups_submitted")),
                                    tokens_generated=int(m.total("tokens_generated")),
                                    reward_failures=int(m.total("reward_failures")),
                                    adapters_received=int(m.total("adapters_received")),
                                    unacked=self.session.num_unacked)

    # -- stopping ----------------------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._mark("stopping")
        unfinished = list(self.rollouts.groups)
        for lease_id in unfinished:
            self.rollouts.remove(lease_id)
        self.session.return_leases(unfinished, "worker stopping")
        deadline = time.monotonic() + STOP_ACK_WAIT_S
        while time.monotonic() < deadline and self.session.num_unacked:
            self.wake.clear()
            self._start_granted()  # a grant answering our last request goes straight back
            self.wake.wait(0.1)
        self._start_granted()
        log.info("stopped", returned=len(unfinished), unacked=self.session.num_unacked,
                 submitted=int(self.metrics.total("groups_submitted")))


def install_stop_handlers(stop: threading.Event, wake: threading.Event, looping: threading.Event) -> list[str]:
    """SIGTERM / SIGINT: before ``looping`` is set raise :class:`StoppedWhileStarting`, then set ``stop`` and
    ``wake``. Returns the list the signals' names go into (the loop logs them).

    Flags only, never a log line: a handler runs between two bytecodes of the main thread, maybe while that
    thread holds the log stream's lock, which structlog takes without reentrancy (a SIGTERM during a burst of
    log lines hung a worker for good).
    """
    received: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if not looping.is_set():  # still connecting or loading the model: nothing is leased, just leave
            raise StoppedWhileStarting(signal.Signals(signum).name)
        received.append(signal.Signals(signum).name)
        stop.set()
        wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return received


def run(config: Config) -> NoReturn:
    """Join the broker, load the backend, generate until SIGTERM; then end the process with the exit code."""
    end_process(_run(config))


def end_process(code: int) -> NoReturn:
    """Flush, run the atexit handlers and leave without the interpreter's teardown (see the module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


def _run(config: Config) -> int:
    worker_id = config.worker.id or default_worker_id()
    bind(worker=worker_id)
    stop, wake, looping = threading.Event(), threading.Event(), threading.Event()
    try:
        received = install_stop_handlers(stop, wake, looping)
        return _join_and_generate(config, worker_id, stop=stop, wake=wake, looping=looping, received=received)
    except StoppedWhileStarting as exc:  # wherever start-up was (the session's finally has run)
        looping.set()  # a second signal now only sets flags
        log.info("stopped_while_starting", signal=str(exc))
        return 0


def _join_and_generate(config: Config, worker_id: str, *, stop: threading.Event, wake: threading.Event,
                       looping: threading.Event, received: list[str]) -> int:
    timeline = Timeline.for_process(config.run_dir, f"worker-{worker_id}")
    timeline.mark("starting")
    metrics = Metrics()
    if config.worker.metrics_port:
        serve_prometheus(metrics, config.worker.metrics_port)
    store = AdapterStore(Path(config.worker.adapter_dir or config.run_dir / "workers" / worker_id / "adapters"))
    session = BrokerSession(config, worker_id=worker_id, store=store, metrics=metrics, wake=wake,
                            security=client_security(config, role="worker"))
    backend: Backend | None = None
    try:
        welcome = session.start(config.run.connect_timeout_s)
        started = time.monotonic()
        backend = make_backend(config, worker_id=worker_id, max_staleness=welcome.max_staleness)
        log.info("backend_ready", load_s=round(time.monotonic() - started, 2), **backend.describe())
        worker = Worker(config, worker_id=worker_id, session=session, backend=backend, store=store, metrics=metrics,
                        wake=wake, stop=stop, timeline=timeline)
        looping.set()
        code = worker.run(received)
    except BrokerUnavailable as exc:
        log.error("broker_unavailable", error=str(exc))
        return 1
    except BrokerRefused as exc:  # too many workers, another protocol version, a key not authorised as a worker
        log.error("broker_refused", error=str(exc))
        return 1
    finally:
        session.close(reason="worker stopping")
        if backend is not None:
            backend.close()
    if code == 0:
        timeline.close()  # the final mark of a clean stop; otherwise "exited" at exit (loraflow.common.timeline)
    return code
