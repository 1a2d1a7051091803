"""Multipart frames on the wire: a fixed preamble, a msgpack header, then raw tensor bytes.

Every loraflow message is one zmq multipart message::

    frame 0   preamble  8 bytes  b"LFLW" | protocol version (u16, big-endian) | message kind (u16)
    frame 1   header    msgpack map: the message's fields, plus "tensors": [{name, dtype, shape, frame}, ...]
    frame 2+  tensors   raw bytes, C-contiguous, one frame per tensor; spec["frame"] counts from frame 2

No pickle, ever: the header is msgpack (size-limited on decode) and tensors are plain bytes whose meaning is
fixed by the declared dtype and shape. :func:`unpack` checks the preamble, the header and that every frame has
exactly the byte size its spec declares before anything else looks at the message.

Buffer lifetime rules (zero copy both ways):

- Sending: :func:`pack` returns views of the callers' arrays, sent with ``copy=False``. A tensor handed to
  ``pack`` must not be mutated until the send has completed; zmq may still read it after ``send_multipart``
  returns (pyzmq copies frames under ``zmq.COPY_THRESHOLD`` = 64 KiB anyway).
- Receiving with ``copy=False``: :func:`as_numpy` and :func:`as_torch` return arrays that *alias* the
  received frame. They stay valid as long as the array is referenced (it keeps the frame alive), but they
  share memory with it: clone before keeping a tensor beyond the message's processing if anything might
  write to it, and never write to one that is also being forwarded.
- The broker never converts tensor frames at all: it keeps the received ``zmq.Frame`` objects and forwards
  them unchanged (re-sending a Frame does not copy its bytes). It only reads them through numpy views to
  validate (finite log-probs, token ids in range).

``bfloat16`` has no numpy dtype: its frames travel as bytes and only become tensors through ``as_torch``.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgpack
import msgspec
import numpy as np

PREAMBLE = struct.Struct("!4sHH")
MAGIC = b"LFLW"

#: bytes per element of every dtype allowed on the wire
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
#: numpy dtype -> its wire name (numpy's ``dtype.name`` is computed in Python, a few microseconds a call)
_WIRE_NAMES: dict[np.dtype, str] = {np.dtype(name): name for name in DTYPE_SIZES if name != "bfloat16"}
MAX_TENSOR_DIMS = 8
MAX_HEADER_BYTES = 4 << 20


class FramingError(ValueError):
    """A multipart message does not have the shape of a loraflow message."""


class Oversize(FramingError):
    """A message is larger than the receiver's limit (``broker.max_message_bytes``)."""


class VersionMismatch(FramingError):
    """The peer speaks another protocol version; ``kind`` and ``peer_version`` say what it sent."""

    def __init__(self, message: str, *, kind: int, peer_version: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.peer_version = peer_version


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one tensor's bytes are and how to read them. The constraints hold for specs decoded by
    :mod:`loraflow.common.protocol` (msgspec checks them in C); :func:`unpack` checks plain maps itself."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    dtype: Literal[tuple(DTYPE_SIZES)]  # type: ignore[valid-type]
    shape: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)], ...], msgspec.Meta(max_length=MAX_TENSOR_DIMS)]
    frame: Annotated[int, msgspec.Meta(ge=0)]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "frame": self.frame}


@dataclass(slots=True)
class Envelope:
    """A received message after framing checks: kind, header, tensor specs and the raw frames.

    :func:`unpack` decodes the header into a plain map; :func:`loraflow.common.codec.decode_envelope` decodes it
    straight into the typed ``record`` (``error`` when that failed its validation) and decodes the plain
    ``header`` only if something asks for it (the Error reply to an invalid record names its ids)."""

    kind: int
    header_bytes: Any  # the msgpack header frame's bytes
    specs: list[TensorSpec]
    frames: list[Any]  # zmq.Frame (or bytes); frames[i] holds the bytes of the spec with frame == i
    num_bytes: int
    record: Any = None  # the typed message record (loraflow.common.protocol)
    error: Exception | None = None  # why the header is not a valid record (loraflow.common.codes.ProtocolError)
    unknown_fields: bool = False  # the header held fields this release does not know (ignored, counted)
    _header: dict[str, Any] | None = None

    @property
    def header(self) -> dict[str, Any]:
        """The header as a plain map, without "tensors" ({} when it is not a map)."""
        if self._header is None:
            try:
                header = msgpack.unpackb(self.header_bytes, raw=False, strict_map_key=False, use_list=True)
            except Exception:  # msgpack raises several unrelated types for corrupt input
                header = None
            self._header = {k: v for k, v in header.items() if k != "tensors"} if isinstance(header, dict) else {}
        return self._header


def pack(kind: int, version: int, header: dict[str, Any], tensors: Sequence[tuple[str, Any]] = ()) -> list[Any]:
    """Frames of one message. ``tensors`` are (name, numpy array or torch tensor) pairs, sent as views."""
    specs = []
    frames: list[Any] = [PREAMBLE.pack(MAGIC, version, kind), b""]
    for index, (name, array) in enumerate(tensors):
        dtype, shape, buffer = wire_array(array)
        specs.append({"name": name, "dtype": dtype, "shape": list(shape), "frame": index})
        frames.append(buffer)
    frames[1] = msgpack.packb({**header, "tensors": specs}, use_bin_type=True)
    return frames


def pack_raw(kind: int, version: int, header: dict[str, Any], specs: Sequence[TensorSpec], frames: Sequence[Any]) -> list[Any]:
    """Frames of a message whose tensor frames are already on hand (the broker forwarding received frames)."""
    wire_specs = [s.to_wire() for s in specs]
    return [PREAMBLE.pack(MAGIC, version, kind), msgpack.packb({**header, "tensors": wire_specs}, use_bin_type=True), *frames]


def wire_array(array: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, byte view) of a numpy array or torch tensor, without copying contiguous data."""
    if isinstance(array, np.ndarray):
        dtype = _WIRE_NAMES.get(array.dtype)
        if dtype is None:
            raise FramingError(f"dtype {array.dtype.str} cannot travel on the wire; allowed (native byte order): "
                               f"{sorted(DTYPE_SIZES)}")
        # (a 0-d array is contiguous: np.ascontiguousarray, which would make it 1-d, only sees n-d views)
        contiguous = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        return dtype, array.shape, memoryview(contiguous.reshape(-1).view(np.uint8))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        dtype = str(array.dtype).removeprefix("torch.")
        if dtype not in DTYPE_SIZES:
            raise FramingError(f"dtype {dtype} cannot travel on the wire; allowed: {sorted(DTYPE_SIZES)}")
        flat = array.detach().to("cpu").contiguous().reshape(-1)
        return dtype, tuple(array.shape), memoryview(flat.view(torch.uint8).numpy())
    raise FramingError(f"cannot send {type(array).__name__} as a tensor; use a numpy array or torch tensor")


def _frame_bytes(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", None)
    return buffer if buffer is not None else memoryview(frame)


def split(frames: Sequence[Any], *, version: int, known_kinds: frozenset[int], max_bytes: int
          ) -> tuple[int, memoryview, list[int]]:
    """(kind, header bytes, byte size of every frame) after the preamble and size checks; raises FramingError
    (:class:`VersionMismatch`, :class:`Oversize`) on bad input. The header is not decoded yet."""
    if len(frames) < 2:
        raise FramingError(f"a message needs at least 2 frames (preamble, header), got {len(frames)}")
    preamble = _frame_bytes(frames[0])
    if preamble.nbytes != PREAMBLE.size:
        raise FramingError(f"preamble must be {PREAMBLE.size} bytes, got {preamble.nbytes}")
    magic, peer_version, kind = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise FramingError(f"not a loraflow message (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if peer_version != version:
        raise VersionMismatch(
            f"protocol version mismatch: peer speaks {peer_version}, this process speaks {version}; "
            "run the same loraflow release on every machine",
            kind=kind,
            peer_version=peer_version,
        )
    if kind not in known_kinds:
        raise FramingError(f"unknown message kind {kind}")
    sizes = [_frame_bytes(f).nbytes for f in frames]
    total = sum(sizes)
    if total > max_bytes:
        raise Oversize(f"message of {total} bytes exceeds the limit of {max_bytes} (broker.max_message_bytes)")
    header_bytes = _frame_bytes(frames[1])
    if header_bytes.nbytes > MAX_HEADER_BYTES:
        raise FramingError(f"header of {header_bytes.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    return kind, header_bytes, sizes


def unpack(frames: Sequence[Any], *, version: int, known_kinds: frozenset[int], max_bytes: int) -> Envelope:
    """Check a received multipart message and split it, the header decoded into a plain map; raises
    FramingError (VersionMismatch, Oversize) on bad input."""
    kind, header_bytes, sizes = split(frames, version=version, known_kinds=known_kinds, max_bytes=max_bytes)
    try:
        header = msgpack.unpackb(header_bytes, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise FramingError(f"header is not valid msgpack: {type(exc).__name__}{': ' if str(exc) else ''}{exc}"
                           ) from None
    if not isinstance(header, dict):
        raise FramingError(f"header must be a msgpack map, got {type(header).__name__}")
    specs = _parse_specs(header.pop("tensors", []), frames[2:], sizes[2:])
    return Envelope(kind=kind, header_bytes=header_bytes, specs=specs, frames=list(frames[2:]), num_bytes=sum(sizes),
                    _header=header)


_SPEC_KEYS = frozenset({"name", "dtype", "shape", "frame"})


def _parse_specs(raw_specs: Any, tensor_frames: Sequence[Any], frame_sizes: Sequence[int] | None = None
                 ) -> list[TensorSpec]:
    if not isinstance(raw_specs, list):
        raise FramingError("header.tensors must be a list")
    if len(raw_specs) != len(tensor_frames):
        raise FramingError(f"header declares {len(raw_specs)} tensors but {len(tensor_frames)} tensor frames arrived")
    if frame_sizes is None:
        frame_sizes = [_frame_bytes(f).nbytes for f in tensor_frames]
    specs = []
    for i, raw in enumerate(raw_specs):
        if not isinstance(raw, dict) or raw.keys() != _SPEC_KEYS:
            raise FramingError(f"tensors[{i}] must be a map with exactly name, dtype, shape, frame")
        name, dtype, shape, frame = raw["name"], raw["dtype"], raw["shape"], raw["frame"]
        if not isinstance(name, str) or not name or len(name) > 256:
            raise FramingError(f"tensors[{i}].name must be a non-empty string of at most 256 characters")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            shown = repr(dtype[:40]) if isinstance(dtype, str) else f"of type {type(dtype).__name__}"
            raise FramingError(f"tensors[{i}] ({name}): dtype {shown} is not one of {sorted(DTYPE_SIZES)}")
        if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
            raise FramingError(f"tensors[{i}] ({name}): shape must be a list of at most {MAX_TENSOR_DIMS} non-negative ints")
        if not isinstance(frame, int) or isinstance(frame, bool):
            raise FramingError(f"tensors[{i}] ({name}): frame index of type {type(frame).__name__} is out of range")
        specs.append(TensorSpec(name, dtype, tuple(shape), frame))
    check_frames(specs, frame_sizes)
    return specs


def check_frames(specs: Sequence[TensorSpec], frame_sizes: Sequence[int]) -> None:
    """Every spec names its own tensor frame, and that frame has exactly the bytes its dtype and shape need."""
    if len(specs) != len(frame_sizes):
        raise FramingError(f"header declares {len(specs)} tensors but {len(frame_sizes)} tensor frames arrived")
    seen = set()
    for i, spec in enumerate(specs):
        frame = spec.frame
        if not 0 <= frame < len(frame_sizes) or frame in seen:
            raise FramingError(f"tensors[{i}] ({spec.name}): frame index {frame} is out of range or used twice")
        seen.add(frame)
        actual, needed = frame_sizes[frame], spec.num_bytes
        if actual != needed:
            raise FramingError(f"tensors[{i}] ({spec.name}): {spec.dtype}{list(spec.shape)} needs {needed} bytes, "
                               f"frame has {actual}")


def as_numpy(spec: TensorSpec, frame: Any) -> np.ndarray:
    """A numpy view aliasing the frame (see buffer lifetime rules). Not for bfloat16."""
    if spec.dtype == "bfloat16":
        raise FramingError(f"{spec.name}: bfloat16 has no numpy dtype; use as_torch")
    return np.frombuffer(_frame_bytes(frame), dtype=np.dtype(spec.dtype)).reshape(spec.shape)


def as_torch(spec: TensorSpec, frame: Any) -> Any:
    """A torch tensor aliasing the frame (see buffer lifetime rules); bf16 kept bit-exact."""
    import torch

    dtype = getattr(torch, spec.dtype)
    if spec.num_bytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    raw = torch.frombuffer(_frame_bytes(frame), dtype=torch.uint8)
    return raw.view(dtype).reshape(spec.shape)


def frames_sha256(frames: Sequence[Any]) -> str:
    """Hex sha256 over the bytes of tensor frames in frame order: the checksum an AdapterUpdate carries."""
    digest = hashlib.sha256()
    for frame in frames:
        digest.update(_frame_bytes(frame))
    return digest.hexdigest()
