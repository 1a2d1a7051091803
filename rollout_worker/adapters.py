"""Received adapter versions: checksum verified, written to disk as PEFT directories, old ones removed.

An AdapterUpdate arrives as a header (version, sha256, PEFT ``adapter_config``) plus one raw frame per LoRA
tensor under its PEFT name. :meth:`AdapterStore.receive` checks the sha256 over the frames
(:func:`loraflow.common.framing.frames_sha256`) and writes ``<adapter_dir>/v<version>/`` with ``adapter_config.json`` and
``adapter_model.safetensors``, the layout ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load. The
safetensors file is written straight from the received frames (an 8-byte header length, a JSON header, the raw
bytes): no torch import and no tensor conversion, so bf16 stays bit-exact and a ``sim`` worker never loads torch.

What an engine loaded is checked against the same checksum: :func:`tensors_sha256` reads a safetensors file's
tensor bytes in data-offset order (the order :func:`write_safetensors` writes the published tensors in), so the
sha256 of the file a backend loads equals ``AdapterUpdate.sha256`` exactly when the file still holds the
published tensors (the evidence of :mod:`loraflow.common.integrity`); :func:`read_tensors` gives a backend that order, each
tensor's shape and the data section as one buffer, so it can move an adapter in one copy and hash what it holds.

Each directory is written under a temporary name and renamed into place, so a reader never sees half an adapter.
The directory belongs to one worker process: what an earlier process left there is removed when the store
opens it, :meth:`AdapterStore.prune` deletes the directories of versions the backend no longer holds and
:meth:`AdapterStore.discard` one that will never be loaded, so the directory holds the versions the worker
serves or keeps for samples under way, plus at most the one waiting to be loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.common.framing import TensorSpec, frames_sha256
from loraflow.common.logging import get_logger
from loraflow.common.protocol import AdapterUpdate

log = get_logger("adapters")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: wire dtype -> safetensors dtype tag
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


class AdapterRejected(ValueError):
    """A received adapter cannot be used; ``reason`` is the counter label (sha256, config)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceivedAdapter:
    """One verified adapter version on local disk."""

    version: int
    sha256: str
    path: Path
    config: dict[str, Any]
    num_bytes: int
    received_unix: float


def write_safetensors(path: Path, specs: Sequence[TensorSpec], frames: Sequence[Any]) -> int:
    """Write tensors in safetensors format from raw frames; returns the number of tensor bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.num_bytes]}
        offset += spec.num_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for spec in specs:
            frame = frames[spec.frame]
            f.write(getattr(frame, "buffer", frame))  # zmq.Frame or any bytes-like object
    return offset


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredTensor:
    """One tensor of a safetensors file: its name, wire dtype, shape and byte range in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_tensors(path: Path) -> tuple[list[StoredTensor], bytearray]:
    """The tensors of a safetensors file in data-offset order (= the published order) and its data section (a
    writable buffer, so ``torch.frombuffer`` can alias it); raises ValueError for a truncated or malformed file."""
    wire = {tag: name for name, tag in SAFETENSORS_DTYPES.items()}
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (no header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        raw = f.read(header_len) if header_len <= 100_000_000 else b""
        if len(raw) != header_len:
            raise ValueError(f"{path}: the safetensors header is cut short")
        data = bytearray(max(0, os.fstat(f.fileno()).st_size - 8 - header_len))
        del data[f.readinto(data):]  # in place: a file cut short while read
    try:
        header = json.loads(raw)
        tensors = sorted((StoredTensor(name=name, dtype=wire.get(entry["dtype"], entry["dtype"]),
                                       shape=tuple(int(n) for n in entry["shape"]),
                                       start=int(entry["data_offsets"][0]), end=int(entry["data_offsets"][1]))
                          for name, entry in header.items() if name != "__metadata__"), key=lambda t: t.start)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{path}: malformed safetensors header ({exc})") from exc
    if tensors and tensors[-1].end > len(data):
        raise ValueError(f"{path}: truncated: the header names {tensors[-1].end} tensor bytes, the file holds "
                         f"{len(data)}")
    return tensors, data


def tensors_sha256(path: Path) -> str:
    """sha256 of a safetensors file's tensor bytes in data-offset order, computed as ``AdapterUpdate.sha256``
    (:func:`loraflow.common.framing.frames_sha256`); raises ValueError for a truncated or malformed file."""
    tensors, data = read_tensors(path)
    view = memoryview(data)
    return frames_sha256([view[t.start:t.end] for t in tensors])


class AdapterStore:
    """Verifies received adapters and keeps them as PEFT directories under ``directory``."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.adapters: dict[int, ReceivedAdapter] = {}
        self._lock = threading.Lock()  # receive() runs on the session's thread, prune() on the worker loop's
        for leftover in self.directory.glob("*v[0-9]*"):  # v<version> and .v<version>.tmp-<pid> of a past process
            if leftover.is_dir() and leftover.name.lstrip(".").startswith("v"):
                shutil.rmtree(leftover, ignore_errors=True)

    def receive(self, update: AdapterUpdate, specs: Sequence[TensorSpec], frames: Sequence[Any]) -> ReceivedAdapter:
        """Verify and write one AdapterUpdate; raises AdapterRejected. A version already held is returned as is."""
        ordered = [frames[s.frame] for s in specs]
        digest = frames_sha256(ordered)
        if digest != update.sha256:
            raise AdapterRejected(f"adapter v{update.version}: sha256 of the tensors is {digest[:12]}..., the "
                                  f"update says {update.sha256[:12]}... (corrupted or mislabelled)", "sha256")
        peft_type = str(update.adapter_config.get("peft_type", "LORA")).upper()
        if peft_type != "LORA" or not update.adapter_config.get("r"):
            raise AdapterRejected(f"adapter v{update.version}: adapter_config must describe a LoRA adapter "
                                  f"(peft_type LORA with r), got peft_type={peft_type!r}", "config")
        for spec in specs:
            if spec.dtype not in SAFETENSORS_DTYPES:
                raise AdapterRejected(f"adapter v{update.version}: {spec.name} has dtype {spec.dtype}", "config")
        with self._lock:
            held = self.adapters.get(update.version)
        if held is not None and held.sha256 == digest:
            return held
        final = self.directory / f"v{update.version:06d}"
        tmp = self.directory / f".v{update.version:06d}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        num_bytes = write_safetensors(tmp / WEIGHTS_FILE, specs, frames)
        (tmp / CONFIG_FILE).write_text(json.dumps(update.adapter_config, indent=1))
        if final.exists():  # an older copy of this version (another checksum): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        adapter = ReceivedAdapter(version=update.version, sha256=digest, path=final, config=update.adapter_config,
                                  num_bytes=num_bytes, received_unix=time.time())
        with self._lock:
            self.adapters[update.version] = adapter
        return adapter

    def prune(self, keep_versions: Collection[int], upto_version: int) -> list[int]:
        """Delete the directories of versions <= ``upto_version`` not in ``keep_versions``; returns them.

        Versions above ``upto_version`` may have arrived since the caller looked and are never touched.
        """
        with self._lock:
            removed = [v for v in self.adapters if v <= upto_version and v not in keep_versions]
            paths = [self.adapters.pop(v).path for v in removed]
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def discard(self, version: int) -> None:
        """Delete the directory of ``version`` (superseded before it was loaded, or refused by the backend)."""
        with self._lock:
            adapter = self.adapters.pop(version, None)
        if adapter is not None:
            shutil.rmtree(adapter.path, ignore_errors=True)
