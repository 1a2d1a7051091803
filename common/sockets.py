"""The one place where zmq sockets get their options.

Every socket gets high-water marks (a second line of backpressure behind the broker's credits), a short
linger (a dying process never hangs on unsent data), TCP keepalive, and optionally CURVE security
(:mod:`common.security`). The broker's ROUTER additionally gets ``ROUTER_MANDATORY`` (sending to a gone or
full peer raises instead of dropping silently), ``ROUTER_HANDOVER`` (a worker reconnecting under the same
identity takes over its old pipe) and ``MAXMSGSIZE`` (zmq disconnects a peer that sends an oversize frame
before it is ever buffered).
"""

from __future__ import annotations

from typing import Any

import zmq

DEFAULT_HWM = 1000
LINGER_MS = 200


def make_context(io_threads: int = 1) -> zmq.Context:
    return zmq.Context(io_threads=io_threads)


def _common_options(sock: zmq.Socket, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)


def router_socket(ctx: zmq.Context, bind: str, *, max_message_bytes: int, hwm: int = DEFAULT_HWM,
                  security: Any = None) -> tuple[zmq.Socket, str]:
    """The broker's ROUTER, bound; returns (socket, the endpoint actually bound, with the real port)."""
    sock = ctx.socket(zmq.ROUTER)
    _common_options(sock, hwm)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if security is not None:
        security.apply_server(sock)
    sock.bind(bind.replace(":0", ":*") if bind.startswith("tcp://") and bind.endswith(":0") else bind)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, endpoint


def dealer_socket(ctx: zmq.Context, endpoint: str, *, identity: bytes, hwm: int = DEFAULT_HWM,
                  security: Any = None) -> zmq.Socket:
    """A client's DEALER, connected to the broker under a stable identity."""
    sock = ctx.socket(zmq.DEALER)
    _common_options(sock, hwm)
    sock.setsockopt(zmq.IDENTITY, identity)
    if security is not None:
        security.apply_client(sock)
    sock.connect(endpoint)
    return sock


def connect_endpoint(bound: str) -> str:
    """An endpoint clients can connect to from one the broker bound (0.0.0.0/* become 127.0.0.1)."""
    return bound.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")
