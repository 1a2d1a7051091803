"""``loraflow run [config.toml]``: a complete run on this machine, supervised, with progress and a result.

With no config it runs the built-in demo (``deploy/configs/demo.toml``)::

    prepare   resolve the model (builtin:demo, builtin:agent-demo: build the warmed-up tiny base of the demo, or of
              the agent demo (deploy/agent_base.py), once per seed, cached),
              choose the run dir (runs/<name>-<time> unless run.run_dir / --run-dir names one: then it resumes),
              write the resolved config to <run_dir>/config.toml (every child reads that file)
    start     broker (port 0 unless broker.bind names one; the bound endpoint is read from its endpoint file),
              then the learner (torchrun when launch.learner_ranks > 1) and launch.num_workers workers, each
              with its GPUs (CUDA_VISIBLE_DEVICES) and metrics port as deploy/devices.py places them
    watch     every 0.25 s: restart crashed children with backoff (deploy/processes.py); every
              launch.progress_every_s: the progress line (deploy/progress.py); every eval.every_s: greedy
              held-out accuracy of the newest adapter directory, in a background thread (an agent config's
              harness plays the episodes: deploy/results.py's evaluate_run)
    stop      at run.num_steps (the learner exits by itself), run.max_duration_s (counted from the launcher's
              start, base build included), eval.target_accuracy, ctrl-C / SIGTERM, or an unrecoverable child:
              SIGTERM to learner and workers (the learner publishes and writes its last adapter, workers return
              their leases), then to the broker (it persists its state)
    finish    final accuracy of the newest adapter, <run_dir>/final_adapter (PEFT dir), summary.json, plots,
              and the two lines ``base accuracy: X%`` / ``final accuracy: Y%``

Before ``prepare``, every role's start-up checks run here (:mod:`loraflow.deploy.preflight`): a setting that cannot work
(a missing model directory, a ``worker.reward`` that does not import, a run dir that cannot be written) ends
``loraflow run`` at once with one line and exit code 2, before anything is created or started.

The launcher's own log goes to ``<run_dir>/logs/launcher.log``; the terminal gets the progress and events.
Exit code: 0 when the run finished, 2 for a config error (found by those checks, or a child that exited with code
2: it refused to start, or stopped mid-run with a config-class error; never restarted), 1 when a child could not
be recovered, 130 after ctrl-C.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from loraflow.common.cli import (
    EXIT_CONFIG_ERROR,
    config_from_args,
    config_parser,
    one_host_torchrun,
    run_main,
)
from loraflow.common.config import Config, write_resolved
from loraflow.common.logging import get_logger, setup_logging
from loraflow.deploy import devices, preflight, rundir
from loraflow.deploy.demo_base import DemoBaseError
from loraflow.deploy.processes import (
    ConfigClassExit,
    Managed,
    RestartPolicy,
    Supervisor,
    Unrecoverable,
    config_class_exit,
)
from loraflow.deploy.progress import Display, Progress, render
from loraflow.deploy.results import Measurement, Summary, accuracy, evaluate_run, print_result, version_step

log = get_logger("launcher")

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.toml"
AGENT_DEMO_MODEL = "builtin:agent-demo"  # deploy/agent_base.py; prepared here (common/startup.py)
TICK_S = 0.25
BROKER_START_TIMEOUT_S = 60.0
LEARNER_STOP_TIMEOUT_S = 90.0
WORKER_STOP_TIMEOUT_S = 30.0
BROKER_STOP_TIMEOUT_S = 20.0

EXTRA_FLAGS = {
    "--workers": ("launch.num_workers", int, "rollout workers to start"),
    "--learner-ranks": ("launch.learner_ranks", int, "learner ranks (torchrun when > 1)"),
    "--max-duration": ("run.max_duration_s", float, "stop after this many seconds (0 = no limit)"),
    "--target-accuracy": ("eval.target_accuracy", float, "stop when held-out accuracy reaches this"),
}


class Launch:
    """One ``loraflow run``: owns the children, the evaluator thread, the display and the summary."""

    def __init__(self, config: Config, display: Display, *, started_s: float) -> None:
        self.config = config
        self.display = display
        self.started_s = started_s
        self.run_dir = config.run_dir
        self.supervisor = Supervisor(RestartPolicy(backoff_s=config.launch.restart_backoff_s,
                                                   max_backoff_s=config.launch.max_backoff_s,
                                                   max_restarts=config.launch.max_restarts),
                                     on_event=display.event, events_path=rundir.processes_path(self.run_dir))
        self.summary = Summary(run_dir=str(self.run_dir), seed=config.run.seed)
        self.endpoint = ""
        self.config_path = self.run_dir / "config.toml"
        self.progress: Progress | None = None
        self.evaluator = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval")
        self.pending_eval: concurrent.futures.Future | None = None
        self.evaluated_version = -1
        self.last_eval_s = 0.0
        self.rl_started_s = 0.0
        self.stop_requested = ""
        self.stop_signal = ""  # the signal behind stop_requested == "interrupted" (shown by watch)
        self.model_ready = False
        self.placement = devices.placement(config)  # every child's GPUs and the evaluation's device
        self.eval_failed = ""  # why evaluation stopped for this run (its GPU ran out of memory)

    # -- start -----------------------------------------------------------------------------------------------

    def prepare_model(self) -> None:
        """Resolve model.path to a directory (building the demo base if needed) and pin it in the config."""
        from loraflow.common.tiny_model import resolve_model

        model = self.config.model
        if model.path == "builtin:demo":
            from loraflow.deploy.demo_base import demo_base_dir, ensure_demo_base, read_metadata

            seed = self.config.run.seed
            if not (demo_base_dir(seed, model.cache_dir or None) / "loraflow_model.json").is_file():
                self.display.event(f"building the demo base model for seed {seed} (once, cached; about 3-4 min on "
                                   "2 cores) ...")
                built = time.monotonic()
                path = ensure_demo_base(seed, model.cache_dir or None)
                self.summary.base_build_s = round(time.monotonic() - built, 1)
                meta = read_metadata(path)
                self.display.event(f"demo base ready in {self.summary.base_build_s:.0f} s: held-out accuracy "
                                   f"{meta['base_accuracy']:.1%} (carry-free {meta['carry_free_accuracy']:.0%}, "
                                   f"with a carry {meta['carry_accuracy']:.0%}); cached in {path}")
            else:
                path = ensure_demo_base(seed, model.cache_dir or None)
        elif model.path == AGENT_DEMO_MODEL:
            path = self.prepare_agent_base()
        else:
            path = resolve_model(model.path, model.cache_dir)
        self.config = dataclasses.replace(self.config, model=dataclasses.replace(model, path=str(path)))
        self.model_ready = True

    def prepare_agent_base(self) -> Path:
        """builtin:agent-demo: the agent demo's base (deploy/agent_base.py), built once per seed and cached."""
        from loraflow.deploy.agent_base import ensure_agent_base, is_built, read_metadata

        seed, cache_dir = self.config.run.seed, self.config.model.cache_dir or None
        if is_built(seed, cache_dir):
            return ensure_agent_base(seed, cache_dir)
        self.display.event(f"building the agent demo base model for seed {seed} (once, cached; about 1-2 min on 2 "
                           "cores) ...")
        built = time.monotonic()
        path = ensure_agent_base(seed, cache_dir)
        self.summary.base_build_s = round(time.monotonic() - built, 1)
        meta = read_metadata(path)
        self.display.event(f"agent demo base ready in {self.summary.base_build_s:.0f} s: held-out first turns that "
                           f"are the right tool call {meta['base_accuracy']:.1%} (first factor below "
                           f"{meta['trusted_below']}: {meta['trusted_accuracy']:.0%}, others "
                           f"{meta['other_accuracy']:.0%}); cached in {path}")
        return path

    def write_config(self) -> None:
        broker = self.config.broker
        endpoint_file = broker.endpoint_file or str(self.run_dir / "broker" / "endpoint")
        self.config = dataclasses.replace(self.config, broker=dataclasses.replace(
            broker, endpoint_file=endpoint_file, bind=broker.bind or "tcp://127.0.0.1:0"))
        write_resolved(self.config, self.config_path)

    def start(self) -> None:
        launch = self.config.launch
        self.display.event(f"starting the broker, the learner ({launch.learner_ranks} rank"
                           f"{'s' if launch.learner_ranks > 1 else ''}) and {launch.num_workers} worker"
                           f"{'s' if launch.num_workers != 1 else ''}; logs in {self.run_dir / 'logs'}")
        if self.placement.visible:
            self.display.event(self.placement.describe())
        self.start_broker(self.config.broker.bind)
        self.display.event(f"broker listening on {self.endpoint}; live picture: loraflow status {self.config_path}")
        self.start_clients()

    def start_clients(self) -> None:
        """The learner and launch.num_workers workers of this run, on the broker at ``self.endpoint``."""
        self.progress = Progress(self.run_dir, self.endpoint, security=self._client_security(),
                                 run=self.config.run.pool_run)
        self.rl_started_s = time.monotonic()
        if not (self.config.run.pool_run and self.config.launch.shared_learner):  # else the pool's trains it
            self.supervisor.add(self._child("learner", self.learner_argv()))
        for i in range(1, self.config.launch.num_workers + 1):
            self.supervisor.add(self._child(f"worker-{i}", self.worker_argv(str(i))))

    def start_broker(self, bind: str) -> None:
        endpoint_file = Path(self.config.broker.endpoint_file)
        endpoint_file.unlink(missing_ok=True)
        argv = self._module("loraflow.broker", "--set", f"broker.bind={json.dumps(bind)}")
        broker = self.supervisor.add(self._child("broker", argv))
        deadline = time.monotonic() + BROKER_START_TIMEOUT_S
        while not (endpoint_file.is_file() and endpoint_file.read_text().strip()):
            if not broker.alive() and broker.popen.returncode == EXIT_CONFIG_ERROR:
                raise config_class_exit(broker)  # broker.bind taken, say: exit 2 like the broker
            if not broker.alive():
                raise Unrecoverable(f"the broker exited with code {broker.popen.returncode} before binding "
                                    f"{bind}; see {broker.log_path}:\n{broker.log_tail()}")
            if time.monotonic() > deadline:
                raise Unrecoverable(f"the broker did not bind {bind} within {BROKER_START_TIMEOUT_S:.0f} s; "
                                    f"see {broker.log_path}")
            time.sleep(0.05)
        self.endpoint = endpoint_file.read_text().strip()
        # a restarted broker must come back on the same address, or the clients could not find it again
        broker.argv = self._module("loraflow.broker", "--set", f"broker.bind={json.dumps(self.endpoint)}")

    def _module(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, str(self.config_path), "--run-dir", str(self.run_dir), *args]

    def learner_argv(self) -> list[str]:
        ranks = self.config.launch.learner_ranks
        args = [str(self.config_path), "--run-dir", str(self.run_dir), "--endpoint", self.endpoint]
        if ranks == 1:
            return [sys.executable, "-m", "loraflow.learner", *args]
        return [sys.executable, *one_host_torchrun(ranks), "-m", "loraflow.learner", *args]

    def worker_argv(self, index: str) -> list[str]:
        """The worker ``index``'s command; on a pool its id names its run (``<run>-<index>``), as the broker and the
        learner's ledger name it."""
        port = devices.worker_metrics_port(self.config, int(index))  # worker.metrics_port + index - 1
        pool_run = self.config.run.pool_run
        return self._module("loraflow.rollout_worker", "--endpoint", self.endpoint,
                            "--worker-id", f"{pool_run}-{index}" if pool_run else index,
                            *(("--set", f"worker.metrics_port={port}") if port else ()))

    def _child(self, name: str, argv: list[str]) -> Managed:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env.update(self.placement.env(name))
        return Managed(name=name, argv=argv, log_path=self.run_dir / "logs" / f"{name}.log", env=env,
                       timeline_path=self.run_dir / "timeline" / f"{name}.jsonl")

    def _client_security(self) -> Any:
        """The progress display's key (the ``observer`` pair unless security.client_key names one)."""
        from loraflow.common.security import client_security

        return client_security(self.config, "observer")

    # -- watch -----------------------------------------------------------------------------------------------

    def watch(self) -> str:
        """Supervise until a stop condition holds; returns the stop reason."""
        next_progress_s = 0.0
        while not self.stop_requested:
            now_s = time.monotonic()
            reason = self.check(now_s)
            if reason:
                return reason
            if now_s >= next_progress_s and self.progress is not None:
                self.display.status(render(self.progress.poll(stats_timeout_s=0.5)))
                next_progress_s = now_s + self.config.launch.progress_every_s
            time.sleep(TICK_S)
        if self.stop_signal:
            self.display.event(f"{self.stop_signal}: stopping every process cleanly (again to kill at once)")
        return self.stop_requested

    def check(self, now_s: float) -> str:
        """One look at the run: crashed children restarted (Unrecoverable when one cannot be), a held-out
        measurement collected or started; the stop reason once a stop condition holds, else ""."""
        run = self.config.run
        for child in self.supervisor.check(now_s):
            if child.name == "learner":
                return f"run.num_steps ({run.num_steps}) reached"
        if run.max_duration_s and now_s - self.started_s >= run.max_duration_s:
            return f"run.max_duration_s ({run.max_duration_s:.0f} s) reached"
        reason = self.collect_eval()
        if not reason:
            self.maybe_start_eval(now_s)
        return reason

    def maybe_start_eval(self, now_s: float) -> None:
        every_s = self.config.eval.every_s
        if not self.config.eval.num_prompts or self.eval_failed:  # eval.num_prompts = 0: no evaluation at all
            return
        if not every_s or self.pending_eval is not None or now_s - self.last_eval_s < every_s:
            return
        version, path = rundir.newest_adapter(self.run_dir)
        if path is None or version <= self.evaluated_version:
            return
        self.last_eval_s = now_s
        self.pending_eval = self.evaluator.submit(self.measure, version, path, "periodic")

    def collect_eval(self, wait: bool = False) -> str:
        """Record a finished periodic measurement; returns a stop reason when it reached the target."""
        future = self.pending_eval
        if future is None or not (wait or future.done()):
            return ""
        self.pending_eval = None
        result: Measurement | None = future.result()
        if result is None:  # evaluation has stopped for this run (measure said why)
            return ""
        if result.kind == "base":
            self.summary.base_accuracy = result.accuracy
            self.display.event(f"held-out accuracy of the base model: {result.accuracy:.1%}")
            return ""
        self.display.event(f"held-out accuracy {result.accuracy:.1%} at v{result.version} (step {result.step}, "
                           f"{time.monotonic() - self.rl_started_s:.0f} s)")
        target = self.config.eval.target_accuracy
        if result.kind == "periodic" and target and result.accuracy >= target:
            self.summary.target_reached_s = round(time.monotonic() - self.rl_started_s, 1)
            return f"eval.target_accuracy ({target:.0%}) reached: {result.accuracy:.1%} at v{result.version}"
        return ""

    def measure(self, version: int, adapter: Path | None, kind: str) -> Measurement | None:
        """Greedy held-out accuracy of the base (adapter None) or base + adapter; appended to evals.jsonl.

        On ``self.placement.eval_device`` (deploy/devices.py). When that GPU runs out of memory, evaluation stops
        for the rest of the run (training goes on), one event says which settings to change, and this and every
        later measurement is None."""
        from loraflow.common.cli import out_of_memory, out_of_memory_line

        config = self.config
        if self.eval_failed:
            return None
        try:
            result = evaluate_run(config, adapter, device=self.placement.eval_device)
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            self.eval_failed = out_of_memory_line("loraflow run", exc)
            log.error("evaluation_out_of_memory", device=self.placement.eval_device, version=version, kind=kind)
            self.display.event(f"{self.eval_failed}; no more held-out evaluations in this run "
                               f"(it was on {self.placement.eval_device})")
            return None
        step = version_step(self.run_dir, version)
        measurement = Measurement(version=version, step=step, accuracy=result.accuracy, time_unix=time.time(),
                                  seconds=round(result.seconds, 3), kind=kind)
        rundir.append_jsonl(rundir.evals_path(self.run_dir), dataclasses.asdict(measurement))
        self.evaluated_version = max(self.evaluated_version, version)
        if self.progress is not None:
            self.progress.set_accuracy(result.accuracy, version)
        log.info("accuracy_measured", version=version, step=step, accuracy=result.accuracy, kind=kind)
        return measurement

    # -- stop ------------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Learner and workers first (the learner needs the broker to publish its last version), then the broker."""
        clients = [name for name in self.supervisor.children if name != "broker"]
        self.supervisor.signal([n for n in clients if n.startswith("worker-")])  # waited for below
        self.supervisor.stop(["learner"], LEARNER_STOP_TIMEOUT_S)
        self.supervisor.stop([n for n in clients if n.startswith("worker-")], WORKER_STOP_TIMEOUT_S)
        self.supervisor.stop(["broker"], BROKER_STOP_TIMEOUT_S)
        self.summary.restarts = {c.name: c.num_restarts for c in self.supervisor.children.values() if c.num_restarts}

    def finish(self) -> None:
        """Final measurement, the final adapter directory, summary.json and plots."""
        summary = self.summary
        summary.steps = max((s["step"] for s in rundir.read_learner_history(self.run_dir).committed), default=0)
        shares = {name: lane.busy_share() for name, lane in rundir.timelines(self.run_dir).items()}
        summary.busy_share = {name: round(share, 4) for name, share in shares.items() if share is not None}
        summary.rl_s = round(time.monotonic() - self.rl_started_s, 1) if self.rl_started_s else 0.0
        if self.pending_eval is not None:
            self.collect_eval(wait=True)
        version, path = rundir.newest_adapter(self.run_dir)
        if self.config.eval.num_prompts and self.model_ready and self.rl_started_s:  # not after a failed start
            if summary.base_accuracy is None:
                summary.base_accuracy = accuracy(self.measure(0, None, "base"))
            summary.final_accuracy = (accuracy(self.measure(version, path, "final")) if path is not None
                                      else summary.base_accuracy)
        if self.config.run.report_to:  # the learner has stopped: the trackers get the evals it did not see
            from loraflow.learner.tracking import log_new_evals

            log_new_evals(self.config)
        if path is not None:
            final = self.run_dir / "final_adapter"
            shutil.rmtree(final, ignore_errors=True)
            shutil.copytree(path, final)
            summary.final_adapter, summary.final_version = str(final), version
        summary.wall_s = round(time.monotonic() - self.started_s, 1)
        rundir.summary_path(self.run_dir).write_text(json.dumps(dataclasses.asdict(summary), indent=1) + "\n")
        try:
            from loraflow.deploy.plots import plot_run

            plot_run(self.run_dir)
        except Exception as exc:  # plots are a convenience: a broken plot never hides the run's result
            log.exception("plots_failed")
            self.display.event(f"plots could not be drawn: {exc}")


def choose_run_dir(config: Config) -> Config:
    """A fresh ``runs/<name>-<time>`` unless the config names a run dir (then an existing one is resumed)."""
    if config.run.run_dir:
        return config
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path("runs") / f"{config.run.name}-{stamp}"
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = Path("runs") / f"{config.run.name}-{stamp}-{suffix}"
    return dataclasses.replace(config, run=dataclasses.replace(config.run, run_dir=str(run_dir)))


def main(argv: list[str]) -> int:
    return run_main("loraflow run", lambda: _main(argv))


def _main(argv: list[str]) -> int:
    started_s = time.monotonic()
    parser = config_parser("loraflow run", "Run the broker, the learner and rollout workers on this machine, "
                           "supervised; with no config, the built-in demo.", EXTRA_FLAGS)
    args = parser.parse_args(argv)
    if args.config is None:
        args.config = str(DEMO_CONFIG)
    config = choose_run_dir(config_from_args(args))
    preflight.check(config, starting=True)  # every role's start-up checks, before anything starts
    run_dir = config.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log_file = open(run_dir / "logs" / "launcher.log", "a")  # noqa: SIM115 - open for the whole run
    setup_logging("launcher", fmt=config.run.log_format, level=config.run.log_level, stream=log_file)
    display = Display(every_s=max(10.0, config.launch.progress_every_s))
    launch = Launch(config, display, started_s=started_s)

    def request_stop(signum: int, _frame: Any) -> None:
        # flags only, no output: the handler may run in the middle of a write to stdout or the log, which do not
        # allow reentry; watch() says what happens, the KeyboardInterrupt handler below kills
        if launch.stop_requested or not launch.supervisor.children:  # again, or nothing started yet: at once
            raise KeyboardInterrupt
        launch.stop_requested = "interrupted"
        launch.stop_signal = signal.Signals(signum).name

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        return run(launch)
    except KeyboardInterrupt:
        launch.supervisor.kill_all()
        display.close()
        display.event("stopped at once: every process killed")
        return 130


def run(launch: Launch) -> int:
    """Prepare, start, watch, stop and report; returns the exit code."""
    config, display = launch.config, launch.display
    display.event(f"loraflow run: {config.run.name} (seed {config.run.seed}, task {config.run.task}), "
                  f"run dir {config.run_dir}")
    code = 0
    try:
        import torch

        torch.set_num_threads(1)  # the launcher only evaluates; leave the cores to the roles
        launch.prepare_model()
        launch.write_config()
        launch.start()
        if config.eval.num_prompts:
            launch.pending_eval = launch.evaluator.submit(launch.measure, 0, None, "base")
        reason = launch.watch()
        launch.summary.stop_reason = reason
        if launch.progress is not None:  # the last picture before stopping
            display.status(render(launch.progress.poll(stats_timeout_s=1.0)), force=True)
        display.close()
        display.event(f"stopping: {reason}")
    except (Unrecoverable, DemoBaseError, ValueError) as exc:
        display.close()
        launch.summary.error = str(exc).splitlines()[0]
        launch.summary.stop_reason = "error"
        display.event(f"error: {exc}")
        code = EXIT_CONFIG_ERROR if isinstance(exc, ConfigClassExit) else 1
    finally:
        launch.shutdown()
    launch.finish()
    launch.evaluator.shutdown(wait=True)
    print_result(launch.summary, sys.stdout)
    if launch.stop_requested == "interrupted" and code == 0:
        code = 130
    return code
