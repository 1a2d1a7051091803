"""``loraflow learner``: parse the config, set up logging, then import torch and run the loop.

One process::

    loraflow learner run.toml --endpoint tcp://broker-host:5555

R ranks on one machine (rank 0 talks to the broker; every rank trains a shard)::

    torchrun --nproc_per_node=R -m loraflow.learner run.toml --endpoint tcp://broker-host:5555

Every running run of a pool over one frozen base (a thread per run, :mod:`loraflow.learner.pool_learner`)::

    loraflow learner runs/pool/config.toml --endpoint tcp://broker-host:5555 --set learner.pool=true

``--resume`` (the default) continues from the newest complete checkpoint in ``<run_dir>/learner/checkpoints``;
``--no-resume`` starts from the base model even if checkpoints exist.

Start-up checks (``model.path``, ``run.run_dir``; :mod:`loraflow.common.startup`; rank 0: the key files) run before the model is loaded or the
broker contacted. Exit codes: 0 stopped cleanly, 2 a configuration error (one line on stderr), 4 replaced by another learner (the broker fenced this
one), 1 anything else. A SIGTERM or SIGINT while the model loads or the session starts (before the loop can finish a
step on one) ends the process at once with 0: nothing was trained or published yet. torchrun reports any failed rank as 1, so a rank that stops with 2 or 4 also writes the
code to ``$LORAFLOW_EXIT_CODE_FILE`` when set; ``deploy/scripts/learner.sh`` exits with it, and the systemd unit
does not restart either.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

from loraflow.common.cli import (
    EXIT_CONFIG_ERROR,
    EXIT_REPLACED,
    config_from_args,
    config_parser,
    out_of_memory,
    run_main,
)
from loraflow.common.config import Config, ConfigError
from loraflow.common.logging import get_logger, setup_logging
from loraflow.common.security import check_keys
from loraflow.common.startup import check_device, check_port_free, check_run_dir, resolve_model
from loraflow.common.transport import BrokerRefused, BrokerUnavailable

EXTRA_FLAGS = {
    "--device": ("learner.device", str, "auto, cpu, cuda or cuda:N"),
    "--checkpoint-every": ("learner.checkpoint_every", int, "DCP checkpoint interval in steps (0 = off)"),
}


def main(argv: list[str]) -> int:
    try:
        code = run_main("loraflow learner", lambda: _main(argv))
    except SystemExit as exc:  # argparse's usage errors
        if exc.code == EXIT_CONFIG_ERROR:
            _record_exit_code(EXIT_CONFIG_ERROR)
        raise
    if code in (EXIT_CONFIG_ERROR, EXIT_REPLACED):
        _record_exit_code(code)
    return code


def check(config: Config) -> Config:
    """The learner's start-up checks, before it loads a model or connects (a failure: one line, exit 2)."""
    config = resolve_model(config)
    if config.worker.backend == "sim" and config.integrity.check:
        raise ConfigError('worker.backend = "sim" makes up its log-probs (no model), so the policy check '
                          "(integrity.check) would refuse every group: set integrity.check = false for a sim run "
                          "(benchmarks and tests of the plumbing)")
    check_run_dir(config)
    check_device("learner.device", config.learner.device, probe_cuda=True)
    if int(os.environ.get("RANK", 0)) == 0:  # only rank 0 talks to the broker
        check_keys(config, "learner")
        check_port_free("learner.metrics_port", config.learner.metrics_port)  # rank 0 serves the metrics
    return config


def _main(argv: list[str]) -> int:
    parser = config_parser("loraflow learner", "Train the LoRA adapter on rollout groups from the broker "
                           "(run under torchrun for several ranks).", EXTRA_FLAGS)
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                        help="continue from the newest complete checkpoint [learner.resume]")
    args = parser.parse_args(argv)
    if args.resume is not None:
        args.overrides.append(f"learner.resume={'true' if args.resume else 'false'}")
    config = check(config_from_args(args))
    setup_logging("learner", fmt=config.run.log_format, level=config.run.log_level,
                  rank=int(os.environ.get("RANK", 0)))
    for signum in (signal.SIGTERM, signal.SIGINT):  # the loop installs its own (finish the step) once it can
        signal.signal(signum, _stop_during_startup)
    try:
        return _start_and_run(config)
    except StoppedDuringStartup as stop:
        get_logger("learner").info("stopped_during_startup", signal=str(stop))
        return 0


class StoppedDuringStartup(BaseException):
    """A stop signal before the training loop took over the handlers (a BaseException: no ``except Exception``
    on the way may swallow it)."""


def _stop_during_startup(signum: int, _frame: Any) -> None:
    raise StoppedDuringStartup(signal.Signals(signum).name)


def _start_and_run(config: Config) -> int:
    from loraflow.learner import pool_learner, start  # torch is imported only now
    from loraflow.learner.session import LearnerReplaced
    from loraflow.learner.start import SetupError

    try:
        return pool_learner.run(config) if config.learner.pool else start.run(config)
    except SetupError as exc:  # found while building the model (learner.target_modules): a config error too
        raise ConfigError(str(exc)) from None
    except LearnerReplaced as exc:
        get_logger("learner").error("learner_replaced", error=str(exc))
        return EXIT_REPLACED
    except (BrokerUnavailable, BrokerRefused) as exc:  # no broker, or keys / security settings that do not match
        get_logger("learner").error("broker_unavailable", error=str(exc))
        return 1
    except Exception as exc:
        if out_of_memory(exc):
            raise  # run_main's one line naming learner.micro_batch_tokens, and EXIT_OUT_OF_MEMORY
        get_logger("learner").exception("learner_failed")
        return 1


def _record_exit_code(code: int) -> None:
    """Write ``code`` to ``$LORAFLOW_EXIT_CODE_FILE`` when set (torchrun reports every failed rank as 1)."""
    path = os.environ.get("LORAFLOW_EXIT_CODE_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(f"{code}\n")
    except OSError as exc:
        get_logger("learner").warning("exit_code_file_failed", path=path, error=str(exc))
