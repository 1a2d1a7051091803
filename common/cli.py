"""Command-line arguments every role shares: the config file, ``--set`` overrides and the common knobs.

Each role's ``main(argv)`` builds its parser with :func:`config_parser`, then calls :func:`config_from_args`,
so ``loraflow worker cfg.toml --endpoint tcp://host:5555 --set worker.temperature=0.7`` and
``python -m rollout_worker cfg.toml ...`` behave the same. Bad values exit with the config error's message.
"""

from __future__ import annotations

import argparse
import json
import sys

from common.config import Config, ConfigError, load_config

#: exit codes the supervisor (deploy/processes.py) and the systemd units act on: restarting will not help
EXIT_CONFIG_ERROR = 2  # a usage or config error (argparse exits 2 too)
EXIT_REPLACED = 4  # a learner fenced by the broker: another learner process took over the run

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
    """Load the config with ``--set`` overrides and flag values applied; exits with a clear message on error."""
    overrides = list(args.overrides)
    for dest, key in args._flag_keys.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    try:
        return load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
