"""A pool learner: one process holding one frozen base that trains every running run of a pool, a thread per run.

``loraflow pool`` with ``launch.shared_learner = true`` starts one of these (``learner.pool = true``) instead of
a learner process per run. Every ``RUN_SCAN_S``::

    runs running now (common/pool_runs.running_runs)  -> a RunLearner thread for each new one
    a trained run that stopped running (finished, cancelled, stopping) -> its learner stops as on SIGTERM: the step
                                                          finishes, the last version is published and written,
                                                          a checkpoint is saved
    a thread that ended                                -> <run dir>/learner/ended (its exit code, why), which the pool
                                                          reads: 0 = the run's learner is done (run.num_steps, or
                                                          stopped), 2 = a config-class error (the run fails); any
                                                          other end is retried from the run's checkpoint up to
                                                          MAX_RETRIES times first

Each RunLearner is an unchanged learner (:func:`loraflow.learner.start.train_run`) over the run's resolved
config: its own LoRA rank and targets, AdamW state, learning-rate schedule, checkpoints, ledger, broker session
(the run named in its Hello) and adapter lineage, so exactly-once and the policy check hold per run as for a
learner of one run. Its policy holds the pool's :class:`~loraflow.learner.model.SharedBase` (the frozen tensors
read once, by the first run built) and adds only its LoRA tensors. One rank: the pool's runs share one device.

Steps take turns on the base (:class:`StepTurns`): the run waiting with the fewest steps per ``run.weight``
goes next, so contending runs get learner steps in proportion to their weights, and a run with no batch holds
nobody back, and one back from idle is owed at most two steps. Log lines carry ``run``. SIGTERM stops every run's learner, then the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loraflow.common import pool_runs
from loraflow.common.cli import EXIT_CONFIG_ERROR
from loraflow.common.config import Config, ConfigError, load_config
from loraflow.common.logging import bind, get_logger
from loraflow.common.tiny_model import resolve_model
from loraflow.learner.model import SharedBase
from loraflow.learner.parallel import Parallel
from loraflow.learner.start import SetupError, start_process, train_run
from loraflow.learner.train import Learner

log = get_logger("learner")

RUN_SCAN_S = 1.0
MAX_RETRIES = 3  # a run's learner that failed (not a config error) is started again from its checkpoint this often
RETRY_DELAY_S = 2.0


class StepTurns:
    """Whose step runs next on the shared base: the waiting run with the fewest weighted steps (steps / weight).

    A run that joins, or comes back after waiting for batches, is at most ``SLACK`` weighted steps behind the
    least-served run waiting now, so idle time is never banked as a claim on many later steps."""

    SLACK = 2.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._waiting: set[str] = set()
        self._served: dict[str, float] = {}  # weighted steps
        self.steps: dict[str, int] = {}

    @contextlib.contextmanager
    def turn(self, run: str, weight: float) -> Iterator[None]:
        with self._cond:
            floor = min((self._served[r] for r in self._waiting), default=None)
            if floor is None:
                floor = min(self._served.values(), default=0.0) + self.SLACK
            self._served[run] = max(self._served.get(run, 0.0), floor - self.SLACK)
            self._waiting.add(run)
            while self._busy or min(self._waiting, key=lambda r: (self._served[r], r)) != run:
                self._cond.wait()
            self._waiting.discard(run)
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._served[run] += 1.0 / weight
                self.steps[run] = self.steps.get(run, 0) + 1
                self._cond.notify_all()

    def forget(self, run: str) -> None:
        with self._cond:
            self._served.pop(run, None)
            self._waiting.discard(run)
            self._cond.notify_all()


def run_config(pool: Config, run_id: str) -> Config:
    """A run's resolved config as the pool learner trains it: the pool's broker address, one process."""
    config = load_config(pool_runs.run_dir(pool, run_id) / pool_runs.RESOLVED)
    return dataclasses.replace(config, broker=dataclasses.replace(config.broker, endpoint=pool.broker.endpoint),
                               learner=dataclasses.replace(config.learner, pool=False, metrics_port=0))


class RunLearner(threading.Thread):
    """One run trained by this process: its learner loop over its policy on the shared base."""

    def __init__(self, config: Config, parallel: Parallel, shared: SharedBase, turns: StepTurns) -> None:
        super().__init__(name=f"learner-{config.run.pool_run}", daemon=True)
        self.config, self.parallel, self.shared, self.turns = config, parallel, shared, turns
        self.run_id = config.run.pool_run
        self.learner: Learner | None = None
        self.stop_reason = ""
        self.code: int | None = None
        self.error = ""

    def attach(self, learner: Learner) -> None:
        self.learner = learner
        log.info("run_trained", lora_rank=self.config.learner.lora_rank, weight=self.config.run.weight,
                 shares_base=self.shared.held_by(learner.policy.model), base_tensors=len(self.shared.parameters),
                 lora_tensors=len(learner.policy.trainable_parameters()))
        if self.stop_reason:
            learner.stop_requested, learner.stop_signal = True, self.stop_reason

    def end(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        if self.learner is not None:
            self.learner.stop_signal = self.learner.stop_signal or reason
            self.learner.stop_requested = True

    def run(self) -> None:
        from loraflow.learner.session import LearnerReplaced

        bind(run=self.run_id)
        weight = self.config.run.weight
        try:
            self.code = train_run(self.config, self.parallel, attach=self.attach, shared=self.shared,
                                  turn=lambda: self.turns.turn(self.run_id, weight))
        except (SetupError, ConfigError) as exc:
            self.code, self.error = EXIT_CONFIG_ERROR, str(exc)
            log.error("run_not_trained", error=self.error)
        except LearnerReplaced as exc:  # another learner took this run over: this process no longer trains it
            self.code, self.error = EXIT_CONFIG_ERROR, f"replaced by another learner: {exc}"
            log.error("learner_replaced", error=str(exc))
        except Exception as exc:  # this run's thread only: the other runs go on
            self.code, self.error = 1, f"{type(exc).__name__}: {exc}"
            log.exception("run_learner_failed")
        finally:
            self.turns.forget(self.run_id)


def write_ended(directory: Path, code: int, reason: str, steps: int) -> None:
    path = pool_runs.learner_ended(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"code": code, "reason": reason, "steps": steps}) + "\n")
    tmp.replace(path)


def serve(pool: Config, parallel: Parallel, *, stop: threading.Event) -> int:
    """Train the pool's running runs until ``stop``; returns the exit code."""
    shared = SharedBase(Path(resolve_model(pool.model.path, pool.model.cache_dir)))
    turns = StepTurns()
    threads: dict[str, RunLearner] = {}
    failures: dict[str, int] = {}
    retry_at: dict[str, float] = {}
    log.info("pool_learner_started", model=str(shared.model_dir))
    try:
        while not stop.is_set():
            running = set(pool_runs.running_runs(pool))
            for run_id, thread in list(threads.items()):
                if run_id not in running:
                    thread.end("run no longer running")
                if thread.is_alive():
                    continue
                thread.join()
                del threads[run_id]
                steps = thread.learner.state.step if thread.learner is not None else 0
                if thread.code not in (0, EXIT_CONFIG_ERROR) and failures.get(run_id, 0) < MAX_RETRIES:
                    failures[run_id] = failures.get(run_id, 0) + 1
                    retry_at[run_id] = time.monotonic() + RETRY_DELAY_S
                    log.warning("run_learner_retried", run=run_id, error=thread.error, attempt=failures[run_id])
                    continue
                reason = thread.error or ("stopped" if thread.stop_reason else "run.num_steps reached")
                write_ended(pool_runs.run_dir(pool, run_id), int(thread.code or 0), reason, steps)
                log.info("run_learner_ended", run=run_id, code=thread.code, reason=reason, steps=steps)
            for run_id in sorted(running - set(threads)):
                directory = pool_runs.run_dir(pool, run_id)
                if pool_runs.learner_ended(directory).exists() or time.monotonic() < retry_at.get(run_id, 0.0):
                    continue  # ended here: the pool has yet to move it on
                thread = RunLearner(run_config(pool, run_id), parallel, shared, turns)
                threads[run_id] = thread
                thread.start()
            stop.wait(RUN_SCAN_S)
    finally:
        for thread in threads.values():
            thread.end("the pool learner stops")
        for thread in threads.values():
            thread.join()  # no ended file: the runs go on when the pool learner is back
    log.info("stopped", runs=sorted(threads), steps=turns.steps)
    return 0


def run(pool: Config) -> int:
    """``loraflow learner POOL.toml --set learner.pool=true``: SIGTERM / SIGINT stop every run's learner."""
    stop = threading.Event()

    def request_stop(_signum: int, _frame: Any) -> None:
        stop.set()  # flags only (see loraflow.learner.start.install_stop_handlers)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    parallel = start_process(pool)
    try:
        if parallel.world_size > 1:
            raise SetupError("learner.pool = true trains every run on one rank; under torchrun each run has its "
                             "own learner (launch.shared_learner = false)")
        return serve(pool, parallel, stop=stop)
    finally:
        parallel.close()
