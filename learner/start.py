"""Starting a run's learner: the process's group and seed, the policy built (or over a pool learner's shared
base), the newest checkpoint loaded, the broker session opened at the resumed version, then the loop of
:mod:`loraflow.learner.train`.

:func:`run` is ``loraflow learner`` for one run: it owns the process (its process group, torch threads, seed and
signal handlers). :func:`train_run` is one run's part, which a pool learner (:mod:`loraflow.learner.pool_learner`)
calls in a thread per run with the pool's shared base, its step turns and its own stop requests.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loraflow.common import versions
from loraflow.common.config import Config, write_resolved
from loraflow.common.logging import bind, get_logger
from loraflow.common.metrics import Metrics, serve_prometheus
from loraflow.common.timeline import Timeline
from loraflow.common.tiny_model import resolve_model
from loraflow.learner import publish, tracking
from loraflow.learner.checkpoint import Checkpointer, LearnerState
from loraflow.learner.ledger import Ledger, newest_published
from loraflow.learner.model import SharedBase, build_policy
from loraflow.learner.parallel import Parallel, init_parallel
from loraflow.learner.session import BrokerSession
from loraflow.learner.step import make_optimizer
from loraflow.learner.train import Learner

log = get_logger("learner")


class SetupError(ValueError):
    """A configuration problem found while building the model; the process exits 2 (no point restarting)."""


def run(config: Config) -> int:
    """Start (or resume) the learner and run the loop until it stops; returns the exit code."""
    parallel = start_process(config)
    try:
        return train_run(config, parallel, attach=install_stop_handlers)
    finally:
        parallel.close()


def start_process(config: Config) -> Parallel:
    """The process's part: its process group (SetupError for a device that cannot work), threads and seed."""
    try:
        parallel = init_parallel(config.learner.device)
    except ValueError as exc:  # learner.device that cannot work for this job (cuda:N on several ranks)
        raise SetupError(str(exc)) from exc
    bind(rank=parallel.rank)
    if config.learner.num_threads:
        torch.set_num_threads(config.learner.num_threads)
    torch.manual_seed(config.run.seed + parallel.rank)
    return parallel


def train_run(config: Config, parallel: Parallel, *, attach: Callable[[Learner], None],
              shared: SharedBase | None = None,
              turn: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> int:
    """One run's learner on ``parallel``: built (over ``shared`` when given), resumed, connected, then its loop;
    ``attach`` is handed the Learner before the loop (to request its stop), ``turn`` held for each step."""
    timeline = Timeline.for_process(config.run_dir, "learner") if parallel.is_main else Timeline(None)
    timeline.mark("starting")  # model build, checkpoint load and connecting show as start-up, not as time down
    learner_dir = config.run_dir / "learner"
    session = None
    try:
        if parallel.is_main:
            learner_dir.mkdir(parents=True, exist_ok=True)
            write_resolved(config, learner_dir / "config.toml")
            resolve_model(config.model.path, config.model.cache_dir)  # builds builtin:tiny once, before the others
        parallel.barrier()
        try:
            tracking.check_available(config.run.report_to)  # a missing wandb/tensorboard: before the model loads
            model_dir = resolve_model(config.model.path, config.model.cache_dir)
            policy = build_policy(Path(model_dir), config.learner, parallel, seed=config.run.seed,
                                  max_message_bytes=config.broker.max_message_bytes, shared=shared)
        except ValueError as exc:  # a model path, target_modules or tracker that cannot work: restarting won't help
            raise SetupError(str(exc)) from exc
        optimizer, scheduler = make_optimizer(policy, config.learner)
        checkpointer = Checkpointer(learner_dir / "checkpoints", keep=config.learner.keep_checkpoints,
                                    parallel=parallel)
        checkpointer.clean_partial()
        state = LearnerState()
        latest = checkpointer.latest() if config.learner.resume else None
        if latest is not None:
            state = checkpointer.load(latest, policy, optimizer, scheduler)
        loaded_version = state.version  # rank 0's _connect may number past it; the weights are this version's
        metrics = Metrics()
        ledger = Ledger(learner_dir / "ledger.jsonl" if parallel.is_main else None)
        if parallel.is_main:
            publish.clean_partial_dirs(learner_dir / "adapters")
            session = _connect(config, state, metrics, ledger)
            if config.learner.metrics_port:
                serve_prometheus(metrics, config.learner.metrics_port)
        learner = Learner(config, parallel, policy, optimizer, scheduler, checkpointer, state, session, metrics,
                          ledger, timeline, turn=turn)
        attach(learner)
        learner.start_history(loaded_version)
        if parallel.broadcast_int(int(state.version > state.checkpoint_version)):
            learner.publish()  # the checkpoint's weights under a new number: replaces the withdrawn versions
        return learner.run()
    finally:
        if session is not None:
            session.close("stopped")


def _connect(config: Config, state: LearnerState, metrics: Metrics, ledger: Ledger) -> BrokerSession:
    """Say hello at the resumed version; withdraw what was published after it and number after it."""
    on_disk = max(publish.newest_adapter_version(config.run_dir / "learner" / "adapters"),
                  newest_published(ledger.path))
    session = BrokerSession(config, version=state.version, metrics=metrics)
    welcome = session.start(config.run.connect_timeout_s)
    ahead = max(on_disk, welcome.latest_version)
    if ahead > state.version:
        # versions published after the checkpoint we resumed from: withdrawn, and their numbers never reused
        state.withdrawn = versions.withdraw(state.withdrawn, state.version + 1, ahead)
        log.info("versions_withdrawn", resumed_version=state.version, withdrawn=state.withdrawn,
                 next_version=ahead + 1)
        state.version = ahead
    ledger.start(session=session.link.hello.session, step=state.step, version=state.version,
                 checkpoint_version=state.checkpoint_version, next_version=state.version + 1,
                 withdrawn=state.withdrawn)
    if welcome.groups_per_step != config.run.groups_per_step or welcome.max_staleness != config.run.max_staleness:
        log.warning("config_differs_from_broker", broker_groups_per_step=welcome.groups_per_step,
                    broker_max_staleness=welcome.max_staleness, groups_per_step=config.run.groups_per_step,
                    max_staleness=config.run.max_staleness)
    return session


def install_stop_handlers(learner: Learner) -> None:
    def request_stop(signum: int, _frame: Any) -> None:
        # flags only, no logging: the handler runs between two bytecodes of the main thread, maybe while it holds
        # the log stream's lock, which structlog takes without reentrancy (the process would hang for good)
        learner.stop_signal = learner.stop_signal or signal.Signals(signum).name
        learner.stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
