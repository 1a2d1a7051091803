"""Entry point of the broker process: parse the config, set up logging, run the server until SIGTERM.

    loraflow broker [config.toml] [--endpoint tcp://host:port] [--set broker.capacity_groups=64] ...

On start the broker restores ``<run_dir>/broker/state.json`` (or ``broker.state_path``) if present, binds
``broker.bind`` (default ``broker.endpoint``; port 0 picks a free port), writes the bound endpoint to
``broker.endpoint_file`` when set (atomically), writes the resolved config to ``<run_dir>/broker/config.toml``,
serves Prometheus ``/metrics`` when ``broker.metrics_port`` > 0, and with ``security.enabled`` accepts only
CURVE clients whose keys lie under ``<security.keys_dir>/authorized/<role>/``. SIGTERM or SIGINT: parked
long-polls are answered, the state is written, exit code 0.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from common.cli import config_from_args, config_parser
from common.config import Config, write_resolved
from common.logging import get_logger, setup_logging
from common.metrics import serve_prometheus
from common.tasks import load_task
from common.tiny_model import default_cache_dir, model_vocab_size

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


def run(config: Config) -> int:
    from broker.core import BrokerCore
    from broker.server import BrokerServer

    security = None
    if config.security.enabled:
        from common.security import SecurityError, ServerSecurity

        try:
            security = ServerSecurity.load(config.security.keys_dir)
        except SecurityError as exc:
            print(f"broker: {exc}", file=sys.stderr)
            return 2
    try:
        task = load_task(config.run.task, config.run.seed)
    except ValueError as exc:
        print(f"broker: {exc}", file=sys.stderr)
        return 2
    vocab_size = vocab_size_for(config)
    if vocab_size == 0:
        log.warning("token_ids_unchecked", model=config.model.path,
                    why="no model directory with a config.json to read vocab_size from")
    state_path = Path(config.broker.state_path or config.run_dir / "broker" / "state.json")
    try:
        core = BrokerCore(config, task=task, vocab_size=vocab_size, state_path=state_path)
    except ValueError as exc:
        print(f"broker: {exc}", file=sys.stderr)
        return 2
    server = BrokerServer(config, core, security=security)
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
    server.serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("loraflow broker", "The broker: prompt leases, the rollout buffer, the adapter relay.")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    config = config_from_args(args)
    setup_logging("broker", fmt=config.run.log_format, level=config.run.log_level)
    return run(config)
