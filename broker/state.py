"""The broker's persisted state: enough to restart without losing a prompt or issuing one twice.

``<run_dir>/broker/state.json`` (or ``broker.state_path``) holds:

- ``cursor``: the next never-issued prompt key when the file was written, and ``reserved_until``: the end of
  the block of keys the cursor may hand out before the next write (:mod:`loraflow.broker.prompts` calls back before
  crossing it, and the server writes synchronously then);
- ``pending``: every issued key not yet trained (queued, leased, buffered, training);
- ``latest_version``: the newest adapter version published, ``latest_sha256`` its checksum (a version number is
  never accepted again with other weights), and ``num_trained_groups`` since the counting base;
- ``uncommitted``: ``[epoch, index, trained_version]`` of trained groups no learner checkpoint covers yet, and
  ``learner_session``: the learner process they belong to. A learner that dies loses the steps after its last
  checkpoint; when a learner of another session says hello at version ``v`` (its checkpoint's), the groups
  trained on parameters of version ``>= v`` are re-queued (see :mod:`loraflow.broker.core`);
- ``withdrawn``: inclusive ``[lo, hi]`` ranges of versions a restarted learner rolled back (never served again,
  no group holding one of their tokens is buffered or trained);
- ``quarantine``: the worker processes quarantined or on probation (:mod:`loraflow.broker.quarantine`), each with its
  session, status, since when (wall clock), counts and last few failures (:class:`QuarantineEntry`), at most
  :data:`loraflow.broker.quarantine.MAX_PERSISTED` of them, and ``num_left_out``: flagged ones past that cap. A file
  written before the field existed loads with none;
- the task identity (``task``, ``seed``, ``epoch_size``) so a state file of another dataset is refused.

What is deliberately *not* kept: the rollout buffer. Buffered and training groups are tensor bytes (up to
``broker.max_buffer_bytes``); writing them would put the disk in the data path of every group. They are not
lost: their keys are ``pending``, so a restarted broker re-queues them, and the groups themselves come back by
the delivery rules: a worker keeps every group until the broker acknowledges it and re-sends the unacknowledged
ones when it sees the new broker (``Reconnected``); a group the old broker had acknowledged is generated again
from its re-queued prompt; a group already trained reaches the new broker as the learner's re-sent BatchAck
(its group ids), which marks the prompt trained and turns any regenerated copy into a duplicate.

On restart every pending key *and* every key of the reserved block is re-queued and the cursor starts after
the block: a key handed out after the last write is inside the block, so it is issued again only as a
re-queued prompt; workers re-send the groups they still hold and duplicates are discarded by group id.
Trained keys leave ``pending`` only in a write that happens before the learner's BatchAck is acknowledged.

The newest adapter is saved next to it (``adapter.bin``: the AdapterUpdate message's frames as received), so a
restarted broker serves the latest version at once instead of waiting for the learner to publish again.

Writes are atomic: a temp file in the same directory, flushed and fsynced, then renamed over the old one.
An fsync costs milliseconds, so the event loop does not wait for the writes that acks depend on:
:class:`StateWriter` writes in a helper thread, always the newest state submitted (group commit: one write
covers every ack handled before it was submitted), and reports which submission is durable; the server sends
an Ack only once the write covering it is durable. Rare writes that must precede what the loop does next
(start, the reserved block, shutdown) are synchronous (:meth:`StateWriter.write`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.broker.prompts import PromptKey
from loraflow.broker.quarantine import MAX_EVIDENCE, MAX_PERSISTED, Status
from loraflow.common.codes import MISMATCH_REASONS
from loraflow.common.protocol import MAX_ID_LEN, MAX_VERSION
from loraflow.common.schema import SchemaError, build, dump, rule

STATE_FORMAT = 1
MAX_QUARANTINE_WINDOW = 10_000  # integrity.quarantine_window's bound


@dataclass(slots=True, kw_only=True)
class EvidenceEntry:
    """One failed group of a flagged worker process (:class:`loraflow.broker.quarantine.Evidence`, wall clock)."""

    group_id: str = rule(max_len=MAX_ID_LEN)
    reason: str = rule(choices=MISMATCH_REASONS)
    version: int = rule(0, ge=0, le=MAX_VERSION)
    num_checked: int = rule(0, ge=0)
    num_off: int = rule(0, ge=0)
    max_abs_diff: float = rule(0.0, ge=0)
    mean_abs_diff: float = rule(0.0, ge=0)
    detail: str = rule("", max_len=512)
    when_unix: float = rule(ge=0, unit="s", doc="when the broker heard of the failure")


@dataclass(slots=True, kw_only=True)
class QuarantineEntry:
    """One quarantined or probation worker process (:class:`loraflow.broker.quarantine.Record`, wall clock)."""

    worker: str = rule(max_len=MAX_ID_LEN, doc="client id")
    session: str = rule(max_len=MAX_ID_LEN, doc="Hello session of the process")
    status: str = rule(choices=(str(Status.QUARANTINED), str(Status.PROBATION)))
    since_unix: float = rule(ge=0, unit="s", doc="when the status was set")
    num_failed: int = rule(0, ge=0, le=MAX_QUARANTINE_WINDOW, doc="failed groups among its last num_checked")
    num_checked: int = rule(0, ge=0, le=MAX_QUARANTINE_WINDOW, doc="its last checked groups (the window)")
    num_quarantines: int = rule(0, ge=0)
    superseded: bool = rule(False, doc="a newer session of its client id said Hello")
    evidence: list[EvidenceEntry] = rule(default_factory=list, max_len=MAX_EVIDENCE, doc="oldest first")


@dataclass(slots=True, kw_only=True)
class QuarantineState:
    entries: list[QuarantineEntry] = rule(default_factory=list, max_len=MAX_PERSISTED)
    num_left_out: int = rule(0, ge=0, doc="flagged processes past the cap, not kept")


@dataclass(slots=True, kw_only=True)
class BrokerState:
    format: int = rule(STATE_FORMAT, ge=1, le=STATE_FORMAT)
    task: str = rule(doc="run.task the keys index into")
    seed: int = rule(ge=0)
    epoch_size: int = rule(0, ge=0, doc="prompts per epoch; 0 = unbounded")
    cursor: list[int] = rule(max_len=2, doc="[epoch, index] of the next never-issued prompt at write time")
    reserved_until: list[int] = rule(max_len=2, doc="[epoch, index]: keys below may have been issued")
    pending: list[list[int]] = rule(default_factory=list, doc="[epoch, index] of issued, untrained prompts")
    latest_version: int = rule(0, ge=0, le=MAX_VERSION, doc="a larger one cannot travel in a token's int32 "
                               "version: such a file was written before versions were bounded; move it away")
    num_trained_groups: int = rule(0, ge=0)
    written_unix: float = rule(0.0, ge=0)
    latest_sha256: str = rule("", max_len=64, doc="checksum of latest_version's adapter tensors")
    learner_session: str = rule("", max_len=128, doc="session of the learner the uncommitted groups belong to")
    uncommitted: list[list[int]] = rule(default_factory=list,
                                        doc="[epoch, index, trained_version] trained after the learner's checkpoint")
    withdrawn: list[list[int]] = rule(default_factory=list, doc="[lo, hi] version ranges rolled back")
    lease_secret: str = rule("", max_len=64, doc="hex key of the MACs that bind lease ids to their holder "
                             "(loraflow.broker.prompts.LeaseTable); kept so that groups re-sent after a restart still verify")
    quarantine: QuarantineState = rule(default_factory=QuarantineState, doc="flagged worker processes")

    @property
    def cursor_key(self) -> PromptKey:
        return _key(self.cursor, "cursor")

    @property
    def reserved_key(self) -> PromptKey:
        return _key(self.reserved_until, "reserved_until")

    def pending_keys(self) -> list[PromptKey]:
        return [_key(k, "pending") for k in self.pending]

    def uncommitted_records(self) -> list[tuple[PromptKey, int]]:
        """(key, trained_version) of the trained groups no learner checkpoint covers, in training order."""
        if any(len(r) != 3 for r in self.uncommitted):
            raise ValueError("broker state: uncommitted entries must be [epoch, index, trained_version]")
        return [(_key(r[:2], "uncommitted"), r[2]) for r in self.uncommitted]

    def withdrawn_ranges(self) -> list[tuple[int, int]]:
        if any(len(r) != 2 or r[0] > r[1] for r in self.withdrawn):
            raise ValueError(f"broker state: withdrawn must hold [lo, hi] ranges, got {self.withdrawn}")
        return [(r[0], r[1]) for r in self.withdrawn]


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(BrokerState))


def _key(value: list[int], name: str) -> PromptKey:
    if len(value) != 2 or min(value) < 0:
        raise ValueError(f"broker state: {name} must be [epoch, index] with non-negative ints, got {value}")
    return value[0], value[1]


def make_state(*, task: str, seed: int, epoch_size: int | None, cursor: PromptKey, reserved_until: PromptKey,
               pending: list[PromptKey], latest_version: int, num_trained_groups: int, latest_sha256: str = "",
               learner_session: str = "", uncommitted: Iterable[tuple[PromptKey, int]] = (),
               withdrawn: Iterable[tuple[int, int]] = (), lease_secret: str = "",
               quarantine: QuarantineState | None = None) -> BrokerState:
    return BrokerState(task=task, seed=seed, epoch_size=epoch_size or 0, cursor=list(cursor),
                       reserved_until=list(reserved_until), pending=[list(k) for k in pending],
                       latest_version=latest_version, num_trained_groups=num_trained_groups,
                       written_unix=round(time.time(), 3), latest_sha256=latest_sha256,
                       learner_session=learner_session, uncommitted=[[*k, v] for k, v in uncommitted],
                       withdrawn=[list(r) for r in withdrawn], lease_secret=lease_secret,
                       quarantine=quarantine or QuarantineState())


def save_state(path: str | os.PathLike, state: BrokerState) -> None:
    """Write atomically: temp file, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        # every field but the quarantine is a plain JSON value already: skip schema.dump's per-element walk (the
        # file is written up to every state_write_interval_ms and holds hundreds of keys); dumps, not dump: only
        # dumps runs in C, calling schema.dump for the records it cannot write (the quarantine's)
        f.write(json.dumps({name: getattr(state, name) for name in _FIELD_NAMES}, separators=(",", ":"),
                           default=dump))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(path: str | os.PathLike) -> BrokerState | None:
    """The persisted state, or None when there is no file; raises ValueError for a corrupt one."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        state = build(BrokerState, json.loads(text), "broker_state")
    except (json.JSONDecodeError, SchemaError) as exc:
        raise ValueError(f"{path}: not a valid broker state file ({exc}); move it away to start the prompt "
                         "cursor from the beginning") from None
    if state.reserved_key < state.cursor_key:
        raise ValueError(f"{path}: reserved_until {state.reserved_until} is before cursor {state.cursor}")
    for i, entry in enumerate(state.quarantine.entries):
        if entry.num_failed > entry.num_checked:
            raise ValueError(f"{path}: not a valid broker state file (broker_state.quarantine.entries[{i}]: "
                             f"num_failed {entry.num_failed} > num_checked {entry.num_checked}); move it away")
    return state


def check_matches(state: BrokerState, *, task: str, seed: int, epoch_size: int | None, path: str) -> None:
    """Refuse a state file written for another dataset (its keys would mean other prompts)."""
    mine = (task, seed, epoch_size or 0)
    theirs = (state.task, state.seed, state.epoch_size)
    if mine != theirs:
        raise ValueError(f"{path} was written for run.task={theirs[0]!r} run.seed={theirs[1]} with "
                         f"{theirs[2] or 'unbounded'} prompts per epoch, but this run has run.task={mine[0]!r} "
                         f"run.seed={mine[1]} with {mine[2] or 'unbounded'}; use the same settings "
                         "(broker.prompt_limit), or another run directory / broker.state_path")


ADAPTER_MAGIC = b"LFAD1\n"
_U32, _U64 = struct.Struct("!I"), struct.Struct("!Q")


def save_adapter(path: str | os.PathLike, message: list[Any]) -> None:
    """Write an adapter message's frames (preamble, header, tensors) atomically: magic, count, (length, bytes)*."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(ADAPTER_MAGIC + _U32.pack(len(message)))
        for frame in message:
            view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
            f.write(_U64.pack(view.nbytes))
            f.write(view)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_adapter(path: str | os.PathLike) -> list[bytes] | None:
    """The frames saved by :func:`save_adapter`, or None when there is no file; ValueError if it is torn."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    if not data.startswith(ADAPTER_MAGIC):
        raise ValueError(f"{path} is not a saved adapter; move it away")
    view = memoryview(data)
    offset = len(ADAPTER_MAGIC)
    (count,) = _U32.unpack_from(view, offset)
    offset += _U32.size
    frames = []
    for _ in range(count):
        (size,) = _U64.unpack_from(view, offset)
        offset += _U64.size
        if offset + size > len(data):
            raise ValueError(f"{path} is truncated; move it away")
        frames.append(data[offset:offset + size])
        offset += size
    return frames


class StateWriter:
    """Writes state files (and the newest adapter), synchronously or in a helper thread; the newest wins.

    Every state gets a sequence number; :attr:`durable_seq` is the newest one on disk. ``on_durable`` is
    called from the helper thread after each background write (the server uses it to wake its poll). An
    adapter handed in with a state is written before that state (to ``adapter_path``), so a state never names a
    latest version whose adapter is not on disk too.

    Background writes start at least ``min_interval_s`` after the previous one ended (group commit): a learner
    stepping faster than that gets one write (two fsyncs) per interval instead of one per step, each covering
    every ack of the interval. A write after a quiet interval starts at once.
    """

    def __init__(self, path: str | os.PathLike, on_durable: Callable[[], None] | None = None,
                 adapter_path: str | os.PathLike | None = None, min_interval_s: float = 0.0) -> None:
        self.path = Path(path)
        self.min_interval_s = min_interval_s
        self._last_write_end = float("-inf")  # time.monotonic() when the previous background write ended
        self.adapter_path = Path(adapter_path) if adapter_path else self.path.with_name("adapter.bin")
        self._adapter_written = 0
        self._pending_adapter: tuple[int, list[Any]] | None = None
        self.on_durable = on_durable
        self.num_writes = 0
        self.last_write_s = 0.0
        self._seq = 0
        self._durable = 0
        self._pending: tuple[int, BrokerState] | None = None
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def durable_seq(self) -> int:
        return self._durable

    def _next_seq(self) -> int:
        with self._cond:
            self._seq += 1
            return self._seq

    def _write(self, seq: int, state: BrokerState, adapter: tuple[int, list[Any]] | None = None) -> None:
        with self._write_lock:
            if adapter is not None and adapter[0] > self._adapter_written:
                save_adapter(self.adapter_path, adapter[1])
                self._adapter_written = adapter[0]
            if seq <= self._durable:
                return  # a newer state is on disk already
            started = time.perf_counter()
            save_state(self.path, state)
            self.last_write_s = time.perf_counter() - started
            self.num_writes += 1
            self._durable = seq

    def write(self, state: BrokerState, adapter: tuple[int, list[Any]] | None = None) -> int:
        """Write now, in the caller's thread; returns the state's sequence number (durable on return)."""
        seq = self._next_seq()
        self._write(seq, state, adapter)
        return seq

    def submit(self, state: BrokerState, adapter: tuple[int, list[Any]] | None = None) -> int:
        """Write in the helper thread; returns the sequence number to wait for (see durable_seq).
        ``adapter`` is (version, message frames): frames that nothing mutates (received zmq frames)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("StateWriter is closed")
            self._seq += 1
            self._pending = (self._seq, state)
            if adapter is not None:
                self._pending_adapter = adapter
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)
                self._thread.start()
            return self._seq

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                while not self._closed and (wait_s := self._last_write_end + self.min_interval_s - time.monotonic()) > 0:
                    self._cond.wait(wait_s)  # newer states replace the pending one meanwhile
                seq, state = self._pending
                adapter, self._pending, self._pending_adapter = self._pending_adapter, None, None
            self._write(seq, state, adapter)
            self._last_write_end = time.monotonic()
            if self.on_durable is not None:
                self.on_durable()

    def close(self) -> None:
        """Finish the pending write (if any) and stop the helper thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
