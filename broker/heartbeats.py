"""The heartbeat fast path: what a connected fleet costs the broker when it only says "still here".

At 4,096 workers beating every second, heartbeats are most of the broker's messages, and nearly all of them say
what the previous one said. The general path (:func:`loraflow.common.protocol.decode_envelope`, role checks, the typed
record, a freshly encoded pong) costs ~12 us of Python per beat before the sockets; this one costs a few:

    frames == [the Heartbeat preamble, header]      (8 bytes compared: magic, protocol version, kind)
      and the sender is registered, in a role that may beat, its CURVE role (if any) its registered one
      and the header decodes strictly (msgspec, in C, the same field types and bounds as :class:`Heartbeat`)
      with ``counters`` left as raw msgpack: decoded and validated (``Numbers``: <= 64 finite numbers under
      names of <= 64 characters) only when the bytes differ from the ones this peer sent last, which were
      validated then
    -> :meth:`HeartbeatPath.decode` returns the beat; the pong is the pre-encoded one for the latest version

Anything else -- a header the strict decode refuses (bad values, unknown fields, tensors), counters that fail
their bounds, an unregistered or fenced sender, a frame too many -- returns None and the message takes the
general path from the start, which refuses and counts it exactly as before (``rejected{reason}``, the Error
text, ``unknown_fields``). So this path only ever accepts what the general one accepts, and decides nothing
the general one would decide otherwise.

Pure logic: no sockets.
"""

from __future__ import annotations

from typing import Any

import msgspec

from loraflow.broker.dispatch import SENDERS
from loraflow.broker.peers import Peer
from loraflow.common import framing, protocol
from loraflow.common.protocol import PROTOCOL_VERSION, Heartbeat, Kind, Numbers

_EMPTY_MAP = msgspec.Raw(b"\x80")  # msgpack's empty map: a beat without counters


def _raw_counters_type() -> type:
    """:class:`Heartbeat` with its ``counters`` kept as raw msgpack (every other field, bound and default as is)."""
    fields: list[Any] = []
    for f in msgspec.structs.fields(Heartbeat):
        if f.name == "counters":
            fields.append((f.name, msgspec.Raw, _EMPTY_MAP))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct("RawCountersHeartbeat", fields, kw_only=True, forbid_unknown_fields=True)


class HeartbeatPath:
    """Decodes the common heartbeat cheaply and keeps the pong encoded (see the module docstring)."""

    def __init__(self, max_message_bytes: int) -> None:
        self.preamble = framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, Kind.HEARTBEAT)
        self._max_header_bytes = min(framing.MAX_HEADER_BYTES, max_message_bytes - len(self.preamble))
        self._decoder = msgspec.msgpack.Decoder(_raw_counters_type())
        self._counters = msgspec.msgpack.Decoder(Numbers)
        self._roles = SENDERS[Kind.HEARTBEAT]
        self._pong_of: tuple[int, float] = (-1, 0.0)  # the (latest version, interval) _pong was encoded for
        self._pong: tuple[list[bytes], int] = ([], 0)  # its frames and their bytes

    def decode(self, frames: list[Any], peer: Peer | None, authenticated_role: str | None) -> Any:
        """The beat (``counters`` decoded into ``counters_dict``, or None when unchanged), or None when the message
        must take the general path."""
        if peer is None or len(frames) != 2 or peer.role not in self._roles or (
                authenticated_role is not None and authenticated_role != peer.role):
            return None
        preamble, header = frames[0], frames[1]
        preamble = getattr(preamble, "buffer", preamble)
        header = getattr(header, "buffer", header)
        if preamble != self.preamble or len(header) > self._max_header_bytes:
            return None
        try:
            beat = self._decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
        if beat.tensors:  # (UNSET and [] are both false: the general path accepts both)
            return None
        raw = beat.counters
        if raw == peer.counters_raw:
            beat.counters = None
            return beat
        try:
            counters = self._counters.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
        beat.counters = counters
        peer.counters_raw = raw.copy()  # (not a view of the received frame: that is let go)
        return beat

    def pong(self, latest_version: int, interval_s: float) -> tuple[list[bytes], int]:
        """The broker's Heartbeat reply at ``latest_version``, asking for beats every ``interval_s``, encoded once
        per (version, interval): (frames, bytes)."""
        of = self._pong_of  # (compared field by field: this runs for every answered beat)
        if of[0] != latest_version or of[1] != interval_s:
            frames = protocol.encode(Heartbeat(latest_version=latest_version, state="idle", interval_s=interval_s))
            self._pong_of, self._pong = (latest_version, interval_s), (frames, sum(len(f) for f in frames))
        return self._pong
