"""framing: zero-copy round trips, bf16 and empty tensors, and every malformed frame named."""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.common import framing
from loraflow.common.framing import FramingError, TensorSpec, VersionMismatch

KINDS = frozenset({1, 2, 3})


def roundtrip(frames: list, max_bytes: int = 1 << 30) -> framing.Envelope:
    """Send through a real zmq pair with copy=False on both ends."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    endpoint = f"inproc://framing-{id(frames)}"
    a.bind(endpoint)
    b.connect(endpoint)
    try:
        a.send_multipart(frames, copy=False)
        return framing.unpack(b.recv_multipart(copy=False), version=1, known_kinds=KINDS, max_bytes=max_bytes)
    finally:
        a.close(0)
        b.close(0)


def test_torch_and_numpy_tensors_round_trip_bit_exact() -> None:
    bf16 = torch.randn(3, 5, dtype=torch.bfloat16)
    big = torch.arange(100_000, dtype=torch.float32)  # above zmq's copy threshold
    ints = np.arange(7, dtype=np.int32)
    frames = framing.pack(2, 1, {"x": 1}, [("bf16", bf16), ("big", big), ("ints", ints), ("empty", torch.empty(0, 4))])
    env = roundtrip(frames)
    assert env.kind == 2 and env.header == {"x": 1}
    got = {s.name: framing.as_torch(s, env.frames[s.frame]) for s in env.specs}
    assert got["bf16"].dtype == torch.bfloat16 and torch.equal(got["bf16"], bf16)
    assert torch.equal(got["big"], big)
    assert torch.equal(got["ints"], torch.from_numpy(ints))
    assert got["empty"].shape == (0, 4)
    np.testing.assert_array_equal(framing.as_numpy(env.specs[2], env.frames[2]), ints)


def test_received_tensor_aliases_its_frame() -> None:
    env = roundtrip(framing.pack(1, 1, {}, [("t", torch.zeros(20_000))]))
    tensor = framing.as_torch(env.specs[0], env.frames[0])
    view = framing.as_numpy(env.specs[0], env.frames[0])
    tensor[0] = 5.0
    assert view[0] == 5.0  # same memory: the lifetime rules in framing's docstring apply


def test_non_contiguous_tensor_is_sent_in_logical_order() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    env = roundtrip(framing.pack(1, 1, {}, [("t", t)]))
    assert torch.equal(framing.as_torch(env.specs[0], env.frames[0]), t)


def good_frames() -> list:
    return framing.pack(1, 1, {"a": 1}, [("t", np.zeros(4, np.float32))])


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda f: f[:1], "at least 2 frames"),
        (lambda f: [b"abc", *f[1:]], "preamble must be"),
        (lambda f: [b"XXXX" + bytes(f[0])[4:], *f[1:]], "not a loraflow message"),
        (lambda f: [f[0], b"\xc1", *f[2:]], "not valid msgpack"),
        (lambda f: [f[0], msgpack.packb([1, 2]), *f[2:]], "must be a msgpack map"),
        (lambda f: [*f, b"extra"], "declares 1 tensors but 2"),
        (lambda f: f[:2], "declares 1 tensors but 0"),
        (lambda f: [*f[:2], b"\x00" * 15], "needs 16 bytes, frame has 15"),
        (lambda f: [f[0], msgpack.packb({"tensors": [{"name": "t", "dtype": "complex64", "shape": [4], "frame": 0}]}), f[2]],
         "dtype 'complex64'"),
        (lambda f: [f[0], msgpack.packb({"tensors": [{"name": "t", "dtype": "float32", "shape": [-4], "frame": 0}]}), f[2]],
         "shape must be"),
        (lambda f: [f[0], msgpack.packb({"tensors": [{"name": "t", "dtype": "float32", "shape": [4], "frame": 3}]}), f[2]],
         "out of range"),
        (lambda f: [f[0], msgpack.packb({"tensors": [{"name": "t", "dtype": "float32", "shape": [2**39, 2**39], "frame": 0}]}), f[2]],
         "needs"),
        (lambda f: [f[0], msgpack.packb({"tensors": "nope"}), f[2]], "must be a list"),
        (lambda f: [f[0], msgpack.packb({"tensors": [{"name": "t"}]}), f[2]], "exactly name, dtype, shape, frame"),
    ],
)
def test_malformed_messages_are_named(mutate, needle: str) -> None:
    frames = [bytes(x) if not isinstance(x, bytes) else x for x in good_frames()]
    with pytest.raises(FramingError, match=needle):
        framing.unpack(mutate(frames), version=1, known_kinds=KINDS, max_bytes=1 << 20)


def test_version_mismatch_and_unknown_kind_and_size_limit() -> None:
    with pytest.raises(VersionMismatch, match="peer speaks 2, this process speaks 1") as info:
        framing.unpack(framing.pack(3, 2, {}), version=1, known_kinds=KINDS, max_bytes=1 << 20)
    assert info.value.kind == 3 and info.value.peer_version == 2
    with pytest.raises(FramingError, match="unknown message kind 9"):
        framing.unpack(framing.pack(9, 1, {}), version=1, known_kinds=KINDS, max_bytes=1 << 20)
    with pytest.raises(FramingError, match="exceeds the limit"):
        framing.unpack(framing.pack(1, 1, {}, [("t", np.zeros(1000, np.float64))]), version=1, known_kinds=KINDS,
                       max_bytes=4000)


def test_unsupported_tensor_types_are_refused() -> None:
    with pytest.raises(FramingError, match="cannot travel"):
        framing.pack(1, 1, {}, [("c", np.zeros(2, np.complex64))])
    # the wire is little-endian (the receivers' numpy views are native): a big-endian array's bytes would be
    # read as other numbers, so it is refused rather than sent under its dtype's name
    with pytest.raises(FramingError, match=r"dtype >i4 cannot travel .*native byte order"):
        framing.pack(1, 1, {}, [("be", np.arange(3, dtype=">i4"))])
    with pytest.raises(FramingError, match="cannot send list"):
        framing.pack(1, 1, {}, [("l", [1, 2])])
    with pytest.raises(FramingError, match="no numpy dtype"):
        framing.as_numpy(TensorSpec("b", "bfloat16", (1,), 0), b"\x00\x00")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_random_frames_never_crash_unpack(frames: list[bytes]) -> None:
    with contextlib.suppress(FramingError):
        framing.unpack(frames, version=1, known_kinds=KINDS, max_bytes=1 << 20)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["float32", "int32", "uint8", "float16", "int64"]),
                          st.lists(st.integers(0, 5), max_size=3)), max_size=4))
def test_any_valid_tensor_list_round_trips(layout: list[tuple[str, list[int]]]) -> None:
    arrays = [(f"t{i}", np.ones(shape, dtype=dtype)) for i, (dtype, shape) in enumerate(layout)]
    env = framing.unpack(framing.pack(1, 1, {}, arrays), version=1, known_kinds=KINDS, max_bytes=1 << 20)
    for (name, array), spec in zip(arrays, env.specs, strict=True):
        assert spec.name == name and spec.shape == array.shape
        np.testing.assert_array_equal(framing.as_numpy(spec, env.frames[spec.frame]), array)
