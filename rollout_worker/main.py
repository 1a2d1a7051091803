"""``loraflow worker`` / ``python -m loraflow.rollout_worker``: parse the config, check it, set up logging, run the worker.

The start-up checks (:mod:`loraflow.rollout_worker.startup`) run before the broker is contacted or a model loaded; a
config-class failure is one line and exit code 2 (:func:`loraflow.common.cli.run_main`). torch and vLLM are imported only
after logging is set up (and not at all by a ``sim`` worker).
"""

from __future__ import annotations

import sys

from loraflow.common.cli import config_from_args, config_parser, run_main
from loraflow.common.logging import setup_logging
from loraflow.rollout_worker.startup import check

EXTRA_FLAGS = {
    "--worker-id": ("worker.id", str, "worker id (default <host>-<pid>)"),
    "--backend": ("worker.backend", str, "hf, vllm or sim"),
    "--capacity": ("worker.capacity", int, "leases (groups) generated concurrently"),
    "--device": ("worker.device", str, "auto, cpu, cuda, cuda:N"),
}


def main(argv: list[str] | None = None) -> int:
    return run_main("loraflow worker", lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    parser = config_parser("loraflow worker", "One rollout worker: leases prompts from the broker, generates "
                           "scored groups with the newest adapter, submits them.", EXTRA_FLAGS)
    config = check(config_from_args(parser.parse_args(argv)))
    setup_logging("worker", fmt=config.run.log_format, level=config.run.log_level)
    if config.worker.pool:  # one engine for every running run of the pool
        from loraflow.rollout_worker.pool_worker import run as serve_pool
        from loraflow.rollout_worker.worker import end_process

        end_process(serve_pool(config))
    from loraflow.rollout_worker.worker import run

    return run(config)
