"""What the tensor frames of a RolloutGroup (alone, or in a Batch) and of an AdapterUpdate must hold, checked
without copying them.

:func:`check_group_layout`, :func:`check_batch_layout` and :func:`check_adapter_layout` compare the tensor specs
with what the record implies (run by :func:`loraflow.common.codec.decode_record`); :func:`check_group_values` reads
a group's tensor contents through numpy views of the received frames (the broker runs it on every group it may
buffer); :func:`group_tensors` gives a checked group's tensors as torch views of its frames.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from loraflow.common import framing
from loraflow.common.codes import ErrorCode, ProtocolError
from loraflow.common.framing import TensorSpec
from loraflow.common.protocol import Batch, RolloutGroup

#: tensors of a rollout group: name -> (dtype, which length list sizes it)
GROUP_TENSORS: dict[str, tuple[str, str]] = {
    "prompt_ids": ("int32", "prompt_lens"),
    "completion_ids": ("int32", "completion_lens"),
    "logprobs": ("float32", "completion_lens"),
    "versions": ("int32", "completion_lens"),
    "loss_mask": ("uint8", "completion_lens"),
}
GROUP_TENSORS_DTYPES = frozenset(dtype for dtype, _ in GROUP_TENSORS.values())


def check_group_layout(group: RolloutGroup, specs: Sequence[TensorSpec]) -> None:
    """Per-sample lists agree in length; the five tensors exist with the right dtypes and 1-D sizes."""
    n = len(group.rewards)
    if n == 0:
        raise ProtocolError(f"RolloutGroup {group.group_id}: a group needs at least one sample")
    for name in ("prompt_lens", "completion_lens", "finish_reasons"):
        if len(getattr(group, name)) != n:
            raise ProtocolError(f"RolloutGroup {group.group_id}: {name} has {len(getattr(group, name))} entries, "
                                f"rewards has {n}")
    if group.min_version > group.max_version:
        raise ProtocolError(f"RolloutGroup {group.group_id}: min_version {group.min_version} > "
                            f"max_version {group.max_version}")
    by_name = {s.name: s for s in specs}
    if len(by_name) != len(specs) or set(by_name) != set(GROUP_TENSORS):
        raise ProtocolError(f"RolloutGroup {group.group_id}: tensors must be exactly {sorted(GROUP_TENSORS)}, "
                            f"got {sorted(s.name for s in specs)}")
    for name, (dtype, lens_field) in GROUP_TENSORS.items():
        spec = by_name[name]
        expected = sum(getattr(group, lens_field))
        if spec.dtype != dtype or spec.shape != (expected,):
            raise ProtocolError(f"RolloutGroup {group.group_id}: {name} must be {dtype}[{expected}], "
                                f"got {spec.dtype}{list(spec.shape)}")


def check_adapter_layout(specs: Sequence[TensorSpec]) -> None:
    if not specs:
        raise ProtocolError("AdapterUpdate carries no tensors")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ProtocolError("AdapterUpdate: tensor names must be unique")
    for s in specs:
        if s.dtype not in ("float32", "float16", "bfloat16"):
            raise ProtocolError(f"AdapterUpdate: {s.name} must be a floating dtype, got {s.dtype}")


def check_batch_layout(batch: Batch, specs: Sequence[TensorSpec]) -> None:
    expected_first = 0
    for i, entry in enumerate(batch.groups):
        if entry.first_tensor != expected_first:
            raise ProtocolError(f"Batch: groups[{i}].first_tensor is {entry.first_tensor}, expected {expected_first}")
        check_group_layout(entry.group, specs[expected_first:expected_first + len(GROUP_TENSORS)])
        expected_first += len(GROUP_TENSORS)
    if expected_first != len(specs):
        raise ProtocolError(f"Batch: {len(specs)} tensors for {len(batch.groups)} groups")


_NUMPY_DTYPES = {name: np.dtype(name) for name in GROUP_TENSORS_DTYPES}
_UINT32 = np.dtype(np.uint32)
_MAX, _MIN = np.maximum.reduce, np.minimum.reduce  # the reductions behind ndarray.max/min, one Python call less


def _group_arrays(specs: Sequence[TensorSpec], frames: Sequence[Any]) -> dict[str, np.ndarray]:
    """name -> numpy view of each tensor frame of a group whose layout was checked (1-D, known dtypes)."""
    arrays = {}
    for s in specs:
        dtype = _NUMPY_DTYPES.get(s.dtype)
        if dtype is None or len(s.shape) != 1:
            arrays[s.name] = framing.as_numpy(s, frames[s.frame])
        else:
            frame = frames[s.frame]
            arrays[s.name] = np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=dtype)
    return arrays


def check_group_values(group: RolloutGroup, specs: Sequence[TensorSpec], frames: Sequence[Any], *,
                       vocab_size: int, latest_version: int) -> None:
    """Tensor contents in range, read through numpy views (no copies): raises ProtocolError('invalid_group').

    - token ids in [0, vocab_size) (when vocab_size > 0)
    - log-probs finite and <= 1e-3 (a log-probability; slack for float rounding) at every position, also where
      loss_mask is 0 (environment tokens carry log-prob 0)
    - loss_mask only 0 or 1; versions within [min_version, max_version] and max_version <= latest_version
    - rewards finite (checked by the record already)

    Seven reductions in all (one pass over each id and mask tensor, two over log-probs and versions).
    """
    arrays = _group_arrays(specs, frames)

    def bad(what: str) -> ProtocolError:
        return ProtocolError(f"RolloutGroup {group.group_id}: {what}", code=ErrorCode.INVALID_GROUP)

    if vocab_size > 0:
        for name in ("prompt_ids", "completion_ids"):
            ids = arrays[name]
            # one pass for both bounds: as unsigned, negative int32 ids are >= 2**31 > any vocab size
            if ids.size and int(_MAX(ids.view(_UINT32))) >= vocab_size:
                raise bad(f"{name} has ids outside [0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}")
    mask = arrays["loss_mask"]
    if mask.size and int(_MAX(mask)) > 1:
        raise bad("loss_mask must hold only 0 and 1")
    logprobs = arrays["logprobs"]
    if logprobs.size:
        high, low = float(_MAX(logprobs)), float(_MIN(logprobs))  # NaN propagates into both
        if not (math.isfinite(high) and math.isfinite(low)):
            raise bad("logprobs contain NaN or inf")
        if high > 1e-3:
            raise bad(f"logprobs must be <= 0, got {high}")
    if group.max_version > latest_version:
        raise bad(f"max_version {group.max_version} is newer than the latest published version {latest_version}")
    versions = arrays["versions"]
    if versions.size:
        oldest, newest = int(_MIN(versions)), int(_MAX(versions))
        if oldest < group.min_version or newest > group.max_version:
            raise bad(f"token versions span [{oldest}, {newest}], header says "
                      f"[{group.min_version}, {group.max_version}]")


def group_tensors(group_specs: Sequence[TensorSpec], frames: Sequence[Any]) -> dict[str, Any]:
    """name -> torch tensor aliasing the frames (see framing's lifetime rules)."""
    return {s.name: framing.as_torch(s, frames[s.frame]) for s in group_specs}
