"""Entry point of the broker process: parse the config, set up logging, run the server until SIGTERM.

    loraflow broker [config.toml] [--endpoint tcp://host:port] [--set broker.capacity_groups=64] ...

On start the broker restores ``<run_dir>/broker/state.json`` (or ``broker.state_path``) if present, binds
``broker.bind`` (default ``broker.endpoint``; port 0 picks a free port), writes the bound endpoint to
``broker.endpoint_file`` when set (atomically), writes the resolved config to ``<run_dir>/broker/config.toml``,
serves Prometheus ``/metrics`` when ``broker.metrics_port`` > 0, and with ``security.enabled`` accepts only
CURVE clients whose keys lie under ``<security.keys_dir>/authorized/<role>/``. SIGTERM or SIGINT: parked
long-polls are answered, the state is written, exit code 0.

Before it binds, the start-up checks run (``model.path``, ``run.run_dir``, ``run.task``, the state and endpoint
files, ``broker.metrics_port``; :mod:`loraflow.common.startup`); those and a bind address that is taken or not on this machine are config errors:
one line naming the setting, exit code 2 (:func:`loraflow.common.cli.run_main`), which supervisors do not restart.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow.common import pool_runs
from loraflow.common.cli import config_from_args, config_parser, run_main
from loraflow.common.config import Config, ConfigError, write_resolved
from loraflow.common.logging import get_logger, setup_logging
from loraflow.common.metrics import serve_prometheus
from loraflow.common.startup import check_port_free, check_run_dir, check_task, check_writable, resolve_model
from loraflow.common.task_base import Task
from loraflow.common.tiny_model import default_cache_dir, model_vocab_size

if TYPE_CHECKING:
    from loraflow.broker.core import BrokerCore

log = get_logger("broker")


def vocab_size_for(config: Config) -> int:
    """The model's vocab size for token-id checks, without importing torch or building a model; 0 = unknown."""
    path = config.model.path
    if path == "builtin:tiny":
        directory = Path(config.model.cache_dir or default_cache_dir()) / "tiny"
    elif path.startswith("builtin:"):
        return 0
    else:
        directory = Path(path)
    return model_vocab_size(directory) if (directory / "config.json").is_file() else 0


def write_endpoint_file(path: str, endpoint: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(endpoint + "\n")
    os.replace(tmp, target)


def check(config: Config) -> tuple[Config, Task]:
    """The broker's start-up checks (a failure: ConfigError, one line, exit 2); returns the config with
    ``builtin:demo`` pinned to its directory, and the task."""
    config = resolve_model(config)
    check_run_dir(config)
    for setting, path in (("broker.state_path", config.broker.state_path),
                          ("broker.endpoint_file", config.broker.endpoint_file)):
        if path:
            check_writable(setting, Path(path).parent, path)
    check_port_free("broker.metrics_port", config.broker.metrics_port)
    return config, check_task(config)


def bind_setting(config: Config) -> str:
    return "broker.bind" if config.broker.bind else "broker.endpoint"


def run(config: Config, task: Task) -> int:
    from loraflow.broker.core import BrokerCore
    from loraflow.broker.pool import BrokerPool
    from loraflow.broker.server import BrokerServer
    from loraflow.common.run_token import broker_token
    from loraflow.common.sockets import AddressInUse, CannotBind

    security = None
    if config.security.enabled:
        from loraflow.common.security import ServerSecurity

        security = ServerSecurity.load(config.security.keys_dir)
    vocab_size = vocab_size_for(config)
    state_path = Path(config.broker.state_path or config.run_dir / "broker" / "state.json")
    run_token = None if security is not None else broker_token(config)  # CURVE keys bind the learner role instead
    try:
        core = BrokerCore(config, task=task, vocab_size=vocab_size, state_path=state_path, run_token=run_token)
    except ConfigError:
        raise
    except ValueError as exc:  # a state file that does not fit this config (broker.state_path)
        raise ConfigError(str(exc)) from None
    pool = BrokerPool(core, make_core=lambda run_id: run_core(config, run_id, vocab_size=vocab_size),
                      runs_dir=pool_runs.runs_dir(config) if config.broker.pool else None)
    try:
        server = BrokerServer(config, pool, security=security)
    except AddressInUse as exc:
        raise ConfigError(f"{bind_setting(config)}: {exc}: another broker may be running there (`loraflow status` "
                          f"asks it), or another program holds the port; stop it, or set {bind_setting(config)} "
                          "to another port (port 0 picks a free one)") from None
    except CannotBind as exc:
        raise ConfigError(f"{bind_setting(config)}: {exc}; bind an address of this machine (tcp://0.0.0.0:PORT "
                          "for every interface)") from None
    if vocab_size == 0:
        log.warning("token_ids_unchecked", model=config.model.path,
                    why="no model directory with a config.json to read vocab_size from")
    write_resolved(config, config.run_dir / "broker" / "config.toml")
    if config.broker.endpoint_file:
        write_endpoint_file(config.broker.endpoint_file, server.endpoint)
    if config.broker.metrics_port:
        serve_prometheus(core.stats.metrics, config.broker.metrics_port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    log.info("broker_started", endpoint=server.endpoint, task=config.run.task, vocab_size=vocab_size,
             state_path=str(state_path), capacity_groups=core.capacity_groups,
             max_buffer_bytes=config.broker.max_buffer_bytes)
    # What startup made (imports, config, the restored state: ~40k objects) lives as long as the process, yet a
    # full collection walks it every time: 11-15 ms of each gen-2 pass inside whatever message it interrupts.
    # Frozen, the collector walks only what serving creates (a cycle made before this line is never freed).
    gc.collect()
    gc.freeze()
    server.serve()
    return 0


def run_core(pool: Config, run_id: str, *, vocab_size: int) -> BrokerCore:
    """The core of a run submitted to this pool broker: its config (the pool's with its own settings on top;
    ConfigError for what the pool refuses), its task, its state file (restored if there) and its run token,
    required with CURVE on too: a learner key authorises the role on every run, the token names one run."""
    from loraflow.broker.core import BrokerCore
    from loraflow.common.run_token import broker_token

    directory = pool_runs.run_dir(pool, run_id)
    config = pool_runs.run_config(pool, run_id, pool_runs.read_settings(directory / pool_runs.SUBMITTED))
    task = check_task(config)
    write_resolved(config, directory / pool_runs.RESOLVED)
    return BrokerCore(config, task=task, vocab_size=vocab_size, state_path=config.run_dir / "broker" / "state.json",
                      run_token=broker_token(config))


def main(argv: list[str] | None = None) -> int:
    return run_main("loraflow broker", lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    parser = config_parser("loraflow broker", "The broker: prompt leases, the rollout buffer, the adapter relay.")
    config, task = check(config_from_args(parser.parse_args(argv)))
    setup_logging("broker", fmt=config.run.log_format, level=config.run.log_level)
    return run(config, task)
