"""Command-line arguments every role shares: the config file, ``--set`` overrides and the common knobs.

Each role's ``main(argv)`` builds its parser with :func:`config_parser`, then calls :func:`config_from_args`,
so ``loraflow worker cfg.toml --endpoint tcp://host:5555 --set worker.temperature=0.7`` and
``python -m rollout_worker cfg.toml ...`` behave the same.

:func:`run_main` is the one place where an entry point's config-class failures become what an operator and a
supervisor need: one line on stderr (``loraflow worker: config error: worker.reward = ...``), no traceback, exit
code :data:`EXIT_CONFIG_ERROR`. Config-class errors are one class, never recognised by their text:
:class:`common.config.ConfigError` (a bad file, ``--set``, value, or a setting the start-up checks of
:mod:`common.startup` and each role refuse) and its subclasses (``SecurityError``: key files; ``DatasetError``:
a dataset that cannot be used). Every role's ``main`` and the ``loraflow`` dispatcher run under it; it also
ends a command quietly when the reader of its output goes away (``loraflow config | head``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Callable

from common.config import Config, ConfigError, load_config

#: exit codes the supervisor (deploy/processes.py) and the systemd units act on: restarting will not help
EXIT_CONFIG_ERROR = 2  # a usage or config error (argparse exits 2 too)
EXIT_REPLACED = 4  # a learner fenced by the broker: another learner process took over the run
EXIT_BROKEN_PIPE = 141  # what a shell reports for a command killed by SIGPIPE (128 + 13), like `cat` in `| head`

#: flag -> (config key, type, help)
COMMON_FLAGS: dict[str, tuple[str, type, str]] = {
    "--endpoint": ("broker.endpoint", str, "broker address clients connect to (tcp://host:port)"),
    "--run-dir": ("run.run_dir", str, "run directory (logs, metrics, checkpoints, adapters)"),
    "--seed": ("run.seed", int, "seed"),
    "--max-staleness": ("run.max_staleness", int, "versions a sample may lag the learner (0 = synchronous)"),
    "--num-steps": ("run.num_steps", int, "learner steps before stopping (0 = until stopped)"),
    "--log-format": ("run.log_format", str, "console or json"),
    "--log-level": ("run.log_level", str, "debug, info, warning, error"),
    "--model": ("model.path", str, "model directory or builtin:tiny"),
}


def config_parser(prog: str, description: str, extra_flags: dict[str, tuple[str, type, str]] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("config", nargs="?", help="TOML config file (defaults are used without one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (TOML syntax), repeatable")
    for flag, (key, kind, text) in {**COMMON_FLAGS, **(extra_flags or {})}.items():
        parser.add_argument(flag, dest=_dest(flag), type=kind, default=None, help=f"{text} [{key}]")
    parser.set_defaults(_flag_keys={_dest(f): key for f, (key, _, _) in {**COMMON_FLAGS, **(extra_flags or {})}.items()})
    return parser


def _dest(flag: str) -> str:
    return "flag_" + flag.lstrip("-").replace("-", "_")


def config_from_args(args: argparse.Namespace) -> Config:
    """Load the config with ``--set`` overrides and flag values applied; raises ConfigError (see run_main)."""
    overrides = list(args.overrides)
    for dest, key in args._flag_keys.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    return load_config(args.config, overrides)


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed (poll reports POLLERR on its writing end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor (a test's captured stdout), or it is closed
        return False


def run_main(prog: str, body: Callable[[], int | None]) -> int:
    """``body()``'s exit code; a config-class error becomes one line on stderr and EXIT_CONFIG_ERROR."""
    try:
        code = int(body() or 0)
        sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's final flush
        return code
    except BrokenPipeError:
        if not stdout_reader_gone():  # a socket's, say: a real failure, not a reader that has read enough
            raise
        # the reader left (`| head`): nothing more to say; stdout goes to /dev/null so exit's flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ConfigError as exc:  # restarting cannot help
        text = " ".join(str(exc).split())  # one line, whatever the message's own line breaks
        print(f"{prog}: config error: {text}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
