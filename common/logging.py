"""structlog set up once per process: console for people, JSON for machines, context bound per role.

Every process calls :func:`setup_logging` first thing. Log lines are short event names with key=value
fields (``log.info("lease_granted", lease_id=..., worker=...)``); the role, client id, rank and policy
version are bound into the context with :func:`bind` so that every line of a process carries them.
Counts and rates go to :mod:`loraflow.common.metrics`, not to log lines.

``kill -USR1 <pid>`` writes the stack of every thread of a process to its log and lets it go on (what a
hung process is waiting for, without py-spy); ``kill -USR1 -<pgid>`` does it for every rank under torchrun.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def setup_logging(role: str, *, fmt: str = "console", level: str = "info", stream: Any = None, **context: Any) -> None:
    """Configure structlog for this process; ``fmt`` is "console" or "json"."""
    stream = stream or sys.stderr
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        colors = stream.isatty() and "NO_COLOR" not in os.environ
        renderer = structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=24)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    bind(role=role, **context)
    # libraries that use stdlib logging (transformers, vLLM) keep their own handlers; quiet the chatty ones
    logging.basicConfig(level=max(_LEVELS[level], logging.WARNING), stream=stream)
    _dump_stacks_on_sigusr1(stream)


def _dump_stacks_on_sigusr1(stream: Any) -> None:
    with contextlib.suppress(AttributeError, OSError, ValueError):  # a stream without a file descriptor (StringIO)
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)


def bind(**context: Any) -> None:
    """Add fields to every later log line of this process (e.g. ``bind(version=3)``)."""
    structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
