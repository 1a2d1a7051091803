"""``loraflow worker`` / ``python -m rollout_worker``: parse the config, set up logging, then run the worker.

torch and vLLM are imported only after logging is set up (and not at all by a ``sim`` worker).
"""

from __future__ import annotations

import sys

from common.cli import config_from_args, config_parser
from common.logging import setup_logging

EXTRA_FLAGS = {
    "--worker-id": ("worker.id", str, "worker id (default <host>-<pid>)"),
    "--backend": ("worker.backend", str, "hf, vllm or sim"),
    "--capacity": ("worker.capacity", int, "leases (groups) generated concurrently"),
    "--device": ("worker.device", str, "auto, cpu, cuda, cuda:N"),
}


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("loraflow worker", "One rollout worker: leases prompts from the broker, generates "
                           "scored groups with the newest adapter, submits them.", EXTRA_FLAGS)
    config = config_from_args(parser.parse_args(sys.argv[1:] if argv is None else argv))
    setup_logging("worker", fmt=config.run.log_format, level=config.run.log_level)
    from rollout_worker.worker import run

    return run(config)
