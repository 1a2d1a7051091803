"""The one place where zmq sockets get their options.

Every socket gets high-water marks (a second line of backpressure behind the broker's credits), a short
linger (a dying process never hangs on unsent data), TCP keepalive, and optionally CURVE security
(:mod:`loraflow.common.security`). The broker's ROUTER additionally gets ``ROUTER_MANDATORY`` (sending to a gone or
full peer raises instead of dropping silently), ``ROUTER_HANDOVER`` (a worker reconnecting under the same
identity takes over its old pipe) and ``MAXMSGSIZE`` (zmq disconnects a peer that sends an oversize frame
before it is ever buffered).
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.backend

DEFAULT_HWM = 1000
LINGER_MS = 200

# pyzmq's compiled socket methods, under zmq.Socket's convenience layer; flags as plain ints (IntFlag arithmetic
# runs in Python for every frame)
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_SNDMORE = int(zmq.SNDMORE)


class CannotBind(OSError):
    """The broker's bind address cannot be bound on this machine (a setting to change, not a crash)."""


class AddressInUse(CannotBind):
    """Another process is bound to the address."""


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
    try:
        sock.bind(bind.replace(":0", ":*") if bind.startswith("tcp://") and bind.endswith(":0") else bind)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        if exc.errno == zmq.EADDRINUSE:
            raise AddressInUse(f"{bind} is in use") from None
        if exc.errno in (zmq.EADDRNOTAVAIL, errno.ENODEV):  # an IP or interface name this host does not have
            raise CannotBind(f"{bind} is not an address of this machine ({exc})") from None
        raise
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, endpoint


def dealer_socket(ctx: zmq.Context, endpoint: str, *, identity: bytes, hwm: int = DEFAULT_HWM,
                  security: Any = None, connect: bool = True) -> zmq.Socket:
    """A client's DEALER, connected to the broker under a stable identity (``connect=False``: configured for
    ``endpoint`` but not yet connected, for a caller that attaches a monitor first)."""
    sock = ctx.socket(zmq.DEALER)
    _common_options(sock, hwm)
    sock.setsockopt(zmq.IDENTITY, identity)
    if security is not None:
        security.apply_client(sock)
    if connect:
        sock.connect(endpoint)
    return sock


def connect_endpoint(bound: str) -> str:
    """An endpoint clients can connect to from one the broker bound (0.0.0.0/* become 127.0.0.1)."""
    return bound.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)`` without pyzmq's per-frame Python layer (about 4x less
    CPU for a message of several small frames; the same zmq calls, errors and copy rules: buffers under
    ``zmq.COPY_THRESHOLD`` are copied, ``zmq.Frame`` objects and larger buffers are sent without copying)."""
    flags = int(flags)
    more = flags | _SNDMORE
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(sock, frame, more if i < last else flags, False, False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``sock.recv_multipart(flags, copy=False)`` without pyzmq's per-frame Python layer (each Frame says
    whether more follow; raises zmq.Again like recv_multipart when NOBLOCK finds nothing)."""
    flags = int(flags)
    frame = _recv(sock, flags, False, False)
    frames = [frame]
    while frame.more:
        frame = _recv(sock, flags, False, False)
        frames.append(frame)
    return frames
