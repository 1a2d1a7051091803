"""``loraflow pool [config.toml]``: one broker on one base model that runs every run submitted to it, supervised.

    loraflow pool pool.toml --run-dir runs/pool          the pool (ctrl-C stops every run cleanly)
    loraflow submit run.toml --pool runs/pool            -> the run's id          (loraflow.deploy.pool_cmds)
    loraflow runs --pool runs/pool                       state, step, reward, held-out accuracy of each run
    loraflow cancel RUN --pool runs/pool                 stop one run; the others go on
    loraflow status runs/pool/config.toml --run RUN      the broker's live picture of one run

The pool's config names what every run shares (the base model, the broker, security, the backend and devices:
:data:`loraflow.common.pool_runs.POOL_KEYS`); a submitted run names the rest. The pool::

    prepare   the base model, resolved once (builtin:demo built and cached as for loraflow run); the pool's
              resolved config (broker.pool = true) in <run_dir>/config.toml, which submit reads
    start     the broker (port 0 unless broker.bind names one), restarted on its address if it dies; with
              launch.shared_workers = N, N shared workers (worker.pool: one engine serving every running run,
              a thread per run, loraflow.rollout_worker.pool_worker), restarted like the broker; with
              launch.shared_learner, one learner training every running run over one frozen base (learner.pool,
              loraflow.learner.pool_learner), restarted like the broker
    watch     every TICK_S: each run the broker accepted (its runs/<id>/config.toml) gets its learner (none with
              the shared learner), launch.num_workers workers (none with shared workers) and its evaluations,
              exactly as one loraflow run would (:class:`loraflow.deploy.launcher.Launch`); a run stops on its own stop conditions
              (run.num_steps, run.max_duration_s, eval.target_accuracy), on a cancel, when one of its processes
              cannot be recovered, or when a shared worker stopped serving it for a config-class error (its
              runs/<id>/workers/<id>/failed), or when the shared learner ended it (runs/<id>/learner/ended),
              and then writes its final adapter, summary.json and plots; the others go on
    stop      ctrl-C / SIGTERM: every active run stops as above, then the shared learner and workers, then the
              broker

A run's state is kept in ``runs/<id>/run_state.json`` (running, stopping, finished, cancelled, failed; with the
reason; shared workers serve the runs in state running), so a restarted pool resumes the runs that were running
(their learners from their checkpoints, the broker from each run's ledger) and leaves the ended ones alone.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Any

from loraflow.common import pool_runs
from loraflow.common.cli import config_from_args, config_parser, run_main
from loraflow.common.config import Config, load_config
from loraflow.common.logging import get_logger, setup_logging
from loraflow.common.pool_runs import ENDED, read_state, write_state
from loraflow.deploy import preflight
from loraflow.deploy.launcher import (
    BROKER_STOP_TIMEOUT_S,
    EXTRA_FLAGS,
    LEARNER_STOP_TIMEOUT_S,
    TICK_S,
    WORKER_STOP_TIMEOUT_S,
    Launch,
)
from loraflow.deploy.processes import Unrecoverable
from loraflow.deploy.progress import Display

log = get_logger("pool")



class RunDisplay:
    """The pool's display, each line of one run prefixed with its id (a run's progress line is not drawn)."""

    def __init__(self, display: Display, run_id: str) -> None:
        self._display, self._prefix = display, f"[{run_id}] "

    def event(self, line: str) -> None:
        self._display.event(self._prefix + line)

    def status(self, line: str, *, force: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


class Pool:
    """One ``loraflow pool``: the broker (in ``self.own``, the pool's own Launch) and a Launch per active run."""

    def __init__(self, config: Config, display: Display, *, started_s: float) -> None:
        config = dataclasses.replace(config, broker=dataclasses.replace(config.broker, pool=True))
        self.own = Launch(config, display, started_s=started_s)
        self.display = display
        self.runs: dict[str, Launch] = {}
        self.stop_requested = ""

    @property
    def shared_workers(self) -> list[str]:
        """The shared workers' process names (their worker ids: shared-<i>)."""
        return [f"worker-shared-{i}" for i in range(1, self.own.config.launch.shared_workers + 1)]

    @property
    def shared_learner(self) -> list[str]:
        """The shared learner's process name, when launch.shared_learner."""
        return ["learner-shared"] if self.own.config.launch.shared_learner else []

    @property
    def runs_dir(self) -> Path:
        return pool_runs.runs_dir(self.own.config)

    def start(self) -> None:
        # imported here once: two runs' evaluation threads importing transformers at once see it half imported
        import peft  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        self.own.prepare_model()
        self.own.write_config()
        self.own.start_broker(self.own.config.broker.bind)
        for name in self.shared_workers:
            index = name.removeprefix("worker-")
            self.own.supervisor.add(self.own._child(name, self.own._module(
                "loraflow.rollout_worker", "--endpoint", self.own.endpoint, "--worker-id", index,
                "--set", "worker.pool=true")))
        for name in self.shared_learner:
            self.own.supervisor.add(self.own._child(name, self.own._module(
                "loraflow.learner", "--endpoint", self.own.endpoint, "--set", "learner.pool=true")))
            self.display.event("a shared learner, training every running run over one base")
        if self.shared_workers:
            self.display.event(f"{len(self.shared_workers)} shared worker(s), each serving every running run")
        self.display.event(f"pool broker on {self.own.endpoint}, base model {self.own.config.model.path}; submit "
                           f"runs with: loraflow submit RUN.toml --pool {self.own.run_dir}")

    def watch(self) -> None:
        while not self.stop_requested:
            now_s = time.monotonic()
            self.own.supervisor.check(now_s)  # the broker, restarted on its address (Unrecoverable: give up)
            self.start_new_runs()
            for run_id, launch in list(self.runs.items()):
                reason, state = self.check_run(run_id, launch, now_s)
                if reason:
                    self.end_run(run_id, launch, state, reason)
            time.sleep(TICK_S)

    def start_new_runs(self) -> None:
        """A Launch for every run the broker accepted that is neither active nor ended."""
        try:
            directories = sorted(p for p in self.runs_dir.iterdir() if p.is_dir())
        except FileNotFoundError:
            return
        for directory in directories:
            run_id = directory.name
            if run_id in self.runs or read_state(directory).get("state") in ENDED:
                continue
            if (directory / pool_runs.CANCELLED).exists():
                write_state(directory, "cancelled", "cancelled before it started")
                continue
            if not (directory / pool_runs.RESOLVED).is_file():
                continue  # not accepted (yet): the broker writes the resolved config, or a refused file
            self.start_run(run_id, directory)

    def start_run(self, run_id: str, directory: Path) -> None:
        config = load_config(directory / pool_runs.RESOLVED)
        if self.shared_workers:  # the shared workers serve it: only its learner is its own
            config = dataclasses.replace(config, launch=dataclasses.replace(config.launch, num_workers=0))
        launch = Launch(config, RunDisplay(self.display, run_id), started_s=time.monotonic())  # type: ignore[arg-type]
        launch.endpoint, launch.model_ready = self.own.endpoint, True
        pool_runs.learner_ended(directory).unlink(missing_ok=True)  # a stop of the last pool's
        write_state(directory, "running")
        workers = f"{len(self.shared_workers)} shared" if self.shared_workers else str(config.launch.num_workers)
        launch.display.event(f"started: task {config.run.task}, seed {config.run.seed}, lr {config.learner.lr:g}, "
                             f"{workers} worker(s); run dir {directory}")
        launch.start_clients()
        if config.eval.num_prompts:
            launch.pending_eval = launch.evaluator.submit(launch.measure, 0, None, "base")
        self.runs[run_id] = launch

    def check_run(self, run_id: str, launch: Launch, now_s: float) -> tuple[str, str]:
        """(stop reason, the state it ends in) of an active run, ("", "") while it goes on."""
        cancelled = self.runs_dir / run_id / pool_runs.CANCELLED
        if cancelled.exists():
            return f"cancelled: {cancelled.read_text().strip() or 'loraflow cancel'}", "cancelled"
        failed = sorted((self.runs_dir / run_id / "workers").glob(f"*/{pool_runs.WORKER_FAILED}"))
        if failed:  # a shared worker stopped serving it (a reward failing on everything, a refused adapter)
            launch.summary.error = f"{failed[0].parent.name}: {failed[0].read_text().strip()}"
            return f"error: {launch.summary.error}", "failed"
        ended = pool_runs.learner_ended(self.runs_dir / run_id)
        if self.shared_learner and ended.is_file():  # the shared learner ended the run by itself
            end = json.loads(ended.read_text())
            if end["code"] == 0:
                return f"run.num_steps ({launch.config.run.num_steps}) reached", "finished"
            launch.summary.error = f"the shared learner: {end['reason']}"
            return f"error: {launch.summary.error}", "failed"
        try:
            return launch.check(now_s), "finished"
        except Exception as exc:  # a process that cannot be recovered (Unrecoverable), a failed evaluation: this run
            log.exception("run_failed", run=run_id)
            launch.summary.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"error: {launch.summary.error}", "failed"

    def end_run(self, run_id: str, launch: Launch, state: str, reason: str) -> None:
        launch.display.event(f"stopping: {reason}")
        write_state(self.runs_dir / run_id, "stopping", reason)  # the shared workers stop serving it
        launch.summary.stop_reason = reason if state != "failed" else "error"
        if self.shared_learner:  # it stops the run's learner on seeing it stopping: the last version published
            ended = pool_runs.learner_ended(self.runs_dir / run_id)
            deadline = time.monotonic() + LEARNER_STOP_TIMEOUT_S
            while not ended.is_file() and time.monotonic() < deadline and self.own.supervisor.children[
                    self.shared_learner[0]].alive():
                time.sleep(TICK_S)
        launch.shutdown()
        launch.finish()
        launch.evaluator.shutdown(wait=True)
        write_state(self.runs_dir / run_id, state, reason)
        summary = launch.summary
        ended = "stopped with the pool (resumed by the next loraflow pool)" if state == "running" else state
        launch.display.event(f"{ended}: final accuracy "
                             f"{'-' if summary.final_accuracy is None else f'{summary.final_accuracy:.1%}'} at "
                             f"v{summary.final_version}, {summary.steps} steps; {summary.final_adapter or 'no adapter'}")
        del self.runs[run_id]

    def shutdown(self, reason: str) -> None:
        self.own.supervisor.signal(self.shared_workers)  # they return their leases while the runs stop
        for run_id, launch in list(self.runs.items()):
            launch.summary.stop_reason = reason
            self.end_run(run_id, launch, "running", reason)  # resumed by the next loraflow pool
        self.own.supervisor.stop(self.shared_learner, LEARNER_STOP_TIMEOUT_S)
        self.own.supervisor.stop(self.shared_workers, WORKER_STOP_TIMEOUT_S)
        self.own.supervisor.stop(["broker"], BROKER_STOP_TIMEOUT_S)


def main(argv: list[str]) -> int:
    return run_main("loraflow pool", lambda: _main(argv))


def _main(argv: list[str]) -> int:
    parser = config_parser("loraflow pool", "One broker on one base model running every run submitted to it "
                           "(loraflow submit), each with its own learner, workers, ledger and adapter lineage.",
                           {**{k: v for k, v in EXTRA_FLAGS.items() if k == "--workers"},
                            "--shared-workers": ("launch.shared_workers", int, "workers serving every run in one "
                                                 "engine (then no run has workers of its own)")})
    parser.add_argument("--shared-learner", action="store_true", help="one learner training every run over one "
                        "base (then no run has a learner of its own) [launch.shared_learner]")
    args = parser.parse_args(argv)
    if args.shared_learner:
        args.overrides.append("launch.shared_learner=true")
    config = config_from_args(args)
    if not config.run.run_dir:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, run_dir=f"runs/pool-{config.run.name}"))
    preflight.check(config, starting=True)
    (config.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log_file = open(config.run_dir / "logs" / "pool.log", "a")  # noqa: SIM115 - open for the whole pool
    setup_logging("pool", fmt=config.run.log_format, level=config.run.log_level, stream=log_file)
    display = Display(every_s=max(10.0, config.launch.progress_every_s))
    pool = Pool(config, display, started_s=time.monotonic())

    def request_stop(signum: int, _frame: Any) -> None:
        if pool.stop_requested:
            raise KeyboardInterrupt
        pool.stop_requested = signal.Signals(signum).name

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    code = 0
    try:
        import torch

        torch.set_num_threads(1)  # the pool only evaluates; leave the cores to the roles
        pool.start()
        pool.watch()
        display.event(f"{pool.stop_requested}: stopping every run cleanly (again to kill at once)")
    except KeyboardInterrupt:
        for launch in pool.runs.values():
            launch.supervisor.kill_all()
        pool.own.supervisor.kill_all()
        display.event("stopped at once: every process killed")
        return 130
    except Unrecoverable as exc:
        display.event(f"error: {exc}")
        code = 1
    pool.shutdown(f"the pool stopped ({pool.stop_requested or 'error'})")
    return code
