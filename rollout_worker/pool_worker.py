"""A shared worker: one engine serving every running run of a pool, a :class:`Worker` thread per run.

``loraflow pool`` with ``launch.shared_workers = N`` starts N of these (``worker.pool = true``) instead of each
run's own workers. The process loads the pool's base model once and then, every ``RUN_SCAN_S``::

    runs running now (common/pool_runs.running_runs)  -> a RunThread for each new one (at most worker.max_runs)
    a served run that stopped running (finished, cancelled, stopping)  -> its thread stops like a worker does:
                                                          leases returned, acks awaited, Bye; its adapters unloaded
    a thread that ended                                -> its run's view released; a config-class end written to
                                                          <run dir>/workers/<id>/failed for the pool to read
    every SHARES_EVERY_S                               -> engine_shares: each run's tokens, weight, seconds held

Each RunThread is an unchanged :class:`~loraflow.rollout_worker.worker.Worker` over the run's own resolved
config (its task, rewards, sampling, group size), its own broker session (the run named in its Hello), its own
adapter store under the run's directory, and the run's view of the shared engine
(:mod:`loraflow.rollout_worker.backends.shared`): versions, requests and evidence are the run's own, so the run's
learner checks every token as for a worker of one run, and the engine is shared by the runs' ``run.weight``.
Log lines carry ``run``.

A run whose reward fails on every sample, or whose adapter the engine refuses, stops being served by this
worker (the file above says why) while the others go on; user code stuck past its timeout holds the whole
process's interpreter, so the process exits ``EXIT_USER_CODE_STUCK`` to be restarted. SIGTERM stops every run's
thread as a worker stops, then the process.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from loraflow.common import pool_runs
from loraflow.common.cli import EXIT_USER_CODE_STUCK
from loraflow.common.config import Config, load_config
from loraflow.common.logging import bind, get_logger
from loraflow.common.metrics import Metrics
from loraflow.common.security import client_security
from loraflow.common.timeline import Timeline
from loraflow.common.transport import BrokerRefused, BrokerUnavailable
from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.backends import Sampling, make_backend
from loraflow.rollout_worker.backends.shared import SharedEngine
from loraflow.rollout_worker.client import BrokerSession
from loraflow.rollout_worker.worker import Worker, default_worker_id, install_stop_handlers

log = get_logger("worker")

RUN_SCAN_S = 1.0
SHARES_EVERY_S = 10.0  # how often the runs' shares of the engine are logged (engine_shares)


def run_config(pool: Config, run_id: str, worker_id: str) -> Config:
    """A run's resolved config as this worker serves it: the pool's broker address and worker id."""
    config = load_config(pool_runs.run_dir(pool, run_id) / pool_runs.RESOLVED)
    return dataclasses.replace(
        config, broker=dataclasses.replace(config.broker, endpoint=pool.broker.endpoint),
        worker=dataclasses.replace(config.worker, id=worker_id, pool=False))


class RunThread(threading.Thread):
    """One run served by this worker: a Worker loop over the run's view of the engine."""

    def __init__(self, config: Config, engine: SharedEngine, *, worker_id: str) -> None:
        super().__init__(name=f"run-{config.run.pool_run}", daemon=True)
        self.config, self.engine, self.worker_id = config, engine, worker_id
        self.run_id = config.run.pool_run
        self.stop, self.wake = threading.Event(), threading.Event()
        self.code: int | None = None
        self.error = ""

    def run(self) -> None:
        bind(worker=self.worker_id, run=self.run_id)
        config, worker_dir = self.config, self.config.run_dir / "workers" / self.worker_id
        metrics = Metrics()
        store = AdapterStore(worker_dir / "adapters")
        session = BrokerSession(config, worker_id=self.worker_id, store=store, metrics=metrics, wake=self.wake,
                                security=client_security(config, role="worker"))
        view = None
        try:
            session.start(config.run.connect_timeout_s)
            sampling = Sampling(temperature=config.worker.temperature, top_p=config.worker.top_p)
            view = self.engine.view(self.run_id, sampling=sampling, wake=self.wake, weight=config.run.weight)
            log.info("run_served", **view.describe())
            worker = Worker(config, worker_id=self.worker_id, session=session, backend=view, store=store,
                            metrics=metrics, wake=self.wake, stop=self.stop,
                            timeline=Timeline.for_process(config.run_dir, f"worker-{self.worker_id}"))
            self.code = worker.run()
            self.error = worker.fatal_error
        except (BrokerUnavailable, BrokerRefused, ValueError) as exc:
            self.code, self.error = 1, str(exc)
            log.error("run_not_served", error=self.error)
        except Exception as exc:  # this run's thread only: the other runs go on
            self.code, self.error = 1, f"{type(exc).__name__}: {exc}"
            log.exception("run_thread_failed")
        finally:
            session.close(reason="run no longer served")
            if view is not None:
                self.engine.release(view)
        if self.code and self.code != EXIT_USER_CODE_STUCK:
            worker_dir.mkdir(parents=True, exist_ok=True)
            (worker_dir / pool_runs.WORKER_FAILED).write_text(f"{self.error or f'exit code {self.code}'}\n")

    def end(self) -> None:
        self.stop.set()
        self.wake.set()


def serve(pool: Config, worker_id: str, *, stop: threading.Event) -> int:
    """Serve the pool's running runs until ``stop``; returns the exit code."""
    started = time.monotonic()
    backend = make_backend(pool, worker_id=worker_id, max_staleness=pool.run.max_staleness)
    engine = SharedEngine(backend)
    log.info("backend_ready", load_s=round(time.monotonic() - started, 2), max_runs=pool.worker.max_runs,
             **backend.describe())
    threads: dict[str, RunThread] = {}
    code = 0
    next_shares_s = time.monotonic() + SHARES_EVERY_S
    try:
        while not stop.is_set():
            if time.monotonic() >= next_shares_s and threads:
                next_shares_s += SHARES_EVERY_S
                log.info("engine_shares", runs=engine.shares())
            running = set(pool_runs.running_runs(pool))
            for run_id, thread in list(threads.items()):
                if run_id not in running:
                    thread.end()
                if not thread.is_alive():
                    thread.join()
                    del threads[run_id]
                    if thread.code == EXIT_USER_CODE_STUCK:
                        code = EXIT_USER_CODE_STUCK
                        stop.set()
            for run_id in sorted(running - set(threads) - ended_here(pool, worker_id)):
                if len(threads) >= pool.worker.max_runs:
                    log.warning("run_waits", run=run_id, max_runs=pool.worker.max_runs,
                                fix="raise worker.max_runs or launch.shared_workers")
                    break
                thread = RunThread(run_config(pool, run_id, worker_id), engine, worker_id=worker_id)
                threads[run_id] = thread
                thread.start()
            stop.wait(RUN_SCAN_S)
    finally:
        for thread in threads.values():
            thread.end()
        for thread in threads.values():
            thread.join()
        backend.close()
    log.info("stopped", runs=sorted(threads))
    return code


def ended_here(pool: Config, worker_id: str) -> set[str]:
    """Runs this worker stopped serving for a config-class error (not served again by this worker id)."""
    found = Path(pool_runs.runs_dir(pool)).glob(f"*/workers/{worker_id}/{pool_runs.WORKER_FAILED}")
    return {path.parents[2].name for path in found}


def run(pool: Config) -> int:
    worker_id = pool.worker.id or default_worker_id()
    bind(worker=worker_id)
    stop, wake, looping = threading.Event(), threading.Event(), threading.Event()
    install_stop_handlers(stop, wake, looping)
    looping.set()  # a signal sets stop; the run threads stop as a worker does
    return serve(pool, worker_id, stop=stop)
