"""Encode and decode of protocol messages: a record plus its tensors to frames, and frames back to a checked record.

A header is decoded straight into its record (:mod:`loraflow.common.protocol`) and validated in C
(:mod:`loraflow.common.wire`): wrong types, missing fields and out-of-range values raise :class:`ProtocolError`
naming the field, and the free-form values each kind carries have their nesting bounded. The preamble, the
protocol version, the size and the tensor frames are checked by :mod:`loraflow.common.framing`. Messages with
tensors (RolloutGroup, AdapterUpdate, Batch) also check that the tensor frames have the names, dtypes and shapes
the header implies (:mod:`loraflow.common.group_checks`); the contents of tensors are checked apart, by
:func:`loraflow.common.group_checks.check_group_values`.

:func:`decode_envelope` and :func:`decode_record` are the two halves of :func:`decode`: the broker checks who
sent a message between them, before a header whose fields are invalid is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
from msgspec import UNSET

from loraflow.common import framing
from loraflow.common.codes import ErrorCode, ProtocolError
from loraflow.common.framing import Envelope, FramingError, TensorSpec
from loraflow.common.group_checks import check_adapter_layout, check_batch_layout, check_group_layout
from loraflow.common.protocol import (
    KNOWN_KINDS,
    MAX_ID_LEN,
    MESSAGES,
    PROTOCOL_VERSION,
    Error,
    Kind,
    LeaseGrant,
    Message,
)
from loraflow.common.wire import WireDecoder, WireError


def _lease_values(grant: LeaseGrant) -> Iterator[tuple[str, Any]]:
    for i, lease in enumerate(grant.leases):
        yield f"leases[{i}].meta", lease.meta
        if lease.columns is not None:
            yield f"leases[{i}].columns", lease.columns
        for j, message in enumerate(lease.prompt_messages or ()):
            yield f"leases[{i}].prompt_messages[{j}]", message


#: where each kind keeps free-form values (their nesting is bounded after the decode, loraflow.common.wire)
_FREE_FORM = {
    Kind.LEASE_GRANT: _lease_values,
    Kind.ADAPTER_UPDATE: lambda update: [("adapter_config", update.adapter_config)],
    Kind.STATS: lambda stats: [("snapshot", stats.snapshot)],
}
_DECODERS = {kind: WireDecoder("Ack" if kind == Kind.ACK else cls.__name__, cls, _FREE_FORM.get(kind))
             for kind, cls in MESSAGES.items()}
_encode_header = msgspec.msgpack.Encoder().encode
_NO_SPECS: list[TensorSpec] = []


def encode(message: Message, tensors: Sequence[tuple[str, Any]] = ()) -> list[Any]:
    """Frames of a message record plus its tensors ((name, array) pairs, sent zero-copy)."""
    specs, buffers = [], []
    for index, (name, array) in enumerate(tensors):
        dtype, shape, buffer = framing.wire_array(array)
        specs.append(TensorSpec(name, dtype, shape, index))
        buffers.append(buffer)
    return encode_with_frames(message, specs, buffers)


def encode_with_frames(message: Message, specs: Sequence[TensorSpec], frames: Sequence[Any]) -> list[Any]:
    """Frames of a message whose tensor frames were received earlier and are forwarded untouched."""
    header = _encode_header(msgspec.structs.replace(message, tensors=list(specs)))
    return [framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, message.KIND), header, *frames]


def decode_envelope(frames: Sequence[Any], max_bytes: int) -> Envelope:
    """Framing checks and the header decoded into its record: raises ProtocolError when the message's shape is
    wrong (preamble, version, size, not msgpack, tensor specs and frames); a header whose *fields* are invalid
    gives an envelope whose ``error`` :func:`decode_record` raises (the broker checks who sent it first)."""
    try:
        kind, header_bytes, sizes = framing.split(frames, version=PROTOCOL_VERSION, known_kinds=KNOWN_KINDS,
                                                  max_bytes=max_bytes)
    except framing.VersionMismatch as exc:
        raise ProtocolError(str(exc), code=ErrorCode.PROTOCOL_VERSION) from None
    except framing.Oversize as exc:
        raise ProtocolError(str(exc), code=ErrorCode.OVERSIZE) from None
    except FramingError as exc:
        raise ProtocolError(str(exc)) from None
    envelope = Envelope(kind=kind, header_bytes=header_bytes, specs=_NO_SPECS, frames=list(frames[2:]),
                        num_bytes=sum(sizes))
    try:
        record, envelope.unknown_fields = _DECODERS[kind].decode(header_bytes)
    except WireError as exc:
        if exc.framing:
            raise ProtocolError(str(exc)) from None
        envelope.error = ProtocolError(str(exc))
        return envelope
    specs = record.tensors
    if specs is not UNSET:
        record.tensors = UNSET
        envelope.specs = specs
    try:
        framing.check_frames(envelope.specs, sizes[2:])
    except FramingError as exc:
        raise ProtocolError(str(exc)) from None
    envelope.record = record
    return envelope


def decode_record(envelope: Envelope) -> Any:
    """The typed record of an envelope, with the tensor layout its kind requires checked."""
    if envelope.error is not None:
        raise envelope.error
    record, kind = envelope.record, envelope.kind
    if kind == Kind.ROLLOUT_GROUP:
        check_group_layout(record, envelope.specs)
    elif kind == Kind.ADAPTER_UPDATE:
        check_adapter_layout(envelope.specs)
    elif kind == Kind.BATCH:
        check_batch_layout(record, envelope.specs)
    elif envelope.specs:
        raise ProtocolError(f"{type(record).__name__} carries no tensors, got {len(envelope.specs)}")
    return record


def decode(frames: Sequence[Any], max_bytes: int = 1 << 31) -> tuple[Any, Envelope]:
    """(record, envelope) of a received multipart message; raises ProtocolError on any bad input."""
    envelope = decode_envelope(frames, max_bytes)
    return decode_record(envelope), envelope


def error_reply(exc: ProtocolError, ref_kind: int = 0, ref_id: str = "") -> Error:
    return Error(code=exc.code, message=str(exc)[:4000], ref_kind=ref_kind, ref_id=ref_id[:MAX_ID_LEN])
