"""The adapters the broker relays: the newest published versions, kept as the frames that arrived, and the
notices that tell every worker about a new one.

    AdapterUpdate -> version advances the latest (or restores it: same version, same sha256, frames lost in a
                     broker restart; a withdrawn version never comes back) -> digest -> kept (AdapterCache)
                     -> Ack after the state write (the adapter file is written with it) -> AdapterNotice to
                     every worker, paced out (NoticePacer)
    AdapterFetch  -> the kept message's frames, forwarded as received (or Error stale_version: not kept)

State, one owner each:

- :class:`AdapterCache`: the newest ``num_kept`` versions. The learner publishes an AdapterUpdate (PEFT tensor
  names, dtypes, shapes, sha256 over the tensor frames in order, :func:`loraflow.common.framing.frames_sha256`).
  The digest is checked once, reading the frames in place (``hashlib`` over memoryviews, no copy), and the
  *whole received message* (preamble, header and tensor frames) is kept and forwarded unchanged to every
  worker that fetches it: re-sending a ``zmq.Frame`` shares its buffer, so sixteen workers fetching a 50 MB
  adapter cost no extra 50 MB copies. Workers a little behind can still fetch the version they ask for; older
  versions are released, and versions a restarted learner rolled back are forgotten at once
  (:meth:`AdapterCache.withdraw`).
- :class:`AdapterRelay`: the newest adapter not yet handed to the state writer. :meth:`AdapterRelay.refusal`
  decides and changes nothing; :meth:`AdapterRelay.publish` applies (see :mod:`loraflow.broker.dispatch`). A
  worker behind the newest version learns of it by the notice, or right after its Welcome, and fetches when it
  wants it: a reconnect storm moves no tensors.
- :class:`NoticePacer`: the AdapterNotices not yet handed out. The zmq I/O thread writes queued messages in
  order, so a publish to a large fleet handed out at once makes every reply sent meanwhile wait behind the
  notices. Each pass's replies go first, then at most :data:`NOTICE_BATCH` notices, and after a full batch
  the next waits :data:`NOTICE_SPACING_S`: a fan-out of 4,096 takes 4,096 / 128 x 5 ms = 160 ms and a reply
  waits behind at most one batch; only a full batch makes the next wait, so up to 128 workers (and a late
  joiner's single notice) get theirs at once. Each worker still gets its notices in order; a notice carries
  no promise to undo (:mod:`loraflow.broker.outbox`), so holding one back is safe.

Pure logic apart from hashing: no sockets.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loraflow.broker.history import RunProgress, TrainingHistory
from loraflow.broker.outbox import Outbox, Outgoing
from loraflow.broker.peers import Peer, PeerRegistry
from loraflow.broker.stats import BrokerStats
from loraflow.common import codec, framing, protocol
from loraflow.common.codes import ProtocolError
from loraflow.common.framing import TensorSpec
from loraflow.common.logging import get_logger
from loraflow.common.protocol import AdapterNotice, AdapterUpdate, Kind

log = get_logger("broker")

NOTICE_BATCH = 128
NOTICE_SPACING_S = 0.005


@dataclass(slots=True, kw_only=True)
class StoredAdapter:
    version: int
    update: AdapterUpdate
    message: list[Any] = field(repr=False)  # the received frames: preamble, header, tensors (forwarded as is)
    num_bytes: int  # tensor bytes
    num_tensors: int
    received_unix: float

    def notice(self) -> AdapterNotice:
        return AdapterNotice(version=self.version, num_bytes=self.num_bytes, sha256=self.update.sha256)


class AdapterCache:
    """The newest ``num_kept`` adapter versions by version number."""

    def __init__(self, num_kept: int) -> None:
        if num_kept < 1:
            raise ValueError(f"broker.num_adapters_kept must be >= 1, got {num_kept}")
        self.num_kept = num_kept
        self._by_version: OrderedDict[int, StoredAdapter] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_version)

    @property
    def newest(self) -> StoredAdapter | None:
        return next(reversed(self._by_version.values()), None)

    def get(self, version: int) -> StoredAdapter | None:
        """The adapter of ``version`` (0 = the newest), or None if not kept."""
        if version == 0:
            return self.newest
        return self._by_version.get(version)

    def add(self, update: AdapterUpdate, specs: Sequence[TensorSpec], message: Sequence[Any],
            verified: bool = False) -> StoredAdapter:
        """Keep a published adapter after checking it (:meth:`verify`, unless ``verified``); ``message`` is every
        received frame (preamble, header, tensors)."""
        if not verified:
            self.verify(update, message)
        stored = StoredAdapter(version=update.version, update=update, message=list(message),
                               num_bytes=sum(s.num_bytes for s in specs), num_tensors=len(specs),
                               received_unix=time.time())
        self._by_version[update.version] = stored
        while len(self._by_version) > self.num_kept:
            self._by_version.popitem(last=False)
        return stored

    def verify(self, update: AdapterUpdate, message: Sequence[Any]) -> None:
        """Raises ProtocolError on a digest mismatch or a version not above the newest kept; changes nothing."""
        newest = self.newest
        if newest is not None and update.version <= newest.version:
            raise ProtocolError(f"AdapterUpdate version {update.version} does not advance the newest kept "
                                f"version {newest.version}", code="stale_version")
        actual = framing.frames_sha256(message[2:])
        if actual != update.sha256.lower():
            raise ProtocolError(f"AdapterUpdate v{update.version}: sha256 of the tensor frames is {actual}, the header "
                                f"says {update.sha256!r} (loraflow.common.framing.frames_sha256 over the tensor frames)")

    def withdraw(self, lo: int, hi: int) -> list[int]:
        """Forget the kept versions in [lo, hi] (a restarted learner rolled them back); returns them."""
        gone = [v for v in self._by_version if lo <= v <= hi]
        for version in gone:
            del self._by_version[version]
        return gone

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"version": a.version, "num_bytes": a.num_bytes, "num_tensors": a.num_tensors,
                 "step": a.update.step, "sha256": a.update.sha256[:12]} for a in self._by_version.values()]


class AdapterRelay:
    """Published adapters: checked, kept, announced, served; the newest one handed to the state writer."""

    def __init__(self, adapters: AdapterCache, *, history: TrainingHistory, progress: RunProgress,
                 peers: PeerRegistry, outbox: Outbox, stats: BrokerStats) -> None:
        self.adapters, self.history, self.progress = adapters, history, progress
        self.peers, self.outbox, self.stats = peers, outbox, stats
        self._unsaved: tuple[int, list[Any]] | None = None  # (version, frames) not yet handed to the writer

    def take_unsaved(self) -> tuple[int, list[Any]] | None:
        """The newest adapter for the next state write (written before that state), once."""
        unsaved, self._unsaved = self._unsaved, None
        return unsaved

    def _restoring(self, update: protocol.AdapterUpdate) -> bool:
        return (update.version == self.progress.latest_version and self.adapters.get(update.version) is None
                and not self.history.is_withdrawn(update.version))

    def refusal(self, update: protocol.AdapterUpdate, frames: list[Any]) -> tuple[str, str] | None:
        """(code, message) when this AdapterUpdate is refused; None when :meth:`publish` may apply it."""
        latest, latest_sha = self.progress.latest_version, self.progress.latest_sha256
        restoring = self._restoring(update)
        if restoring and latest_sha and update.sha256.lower() != latest_sha.lower():
            return "stale_version", (f"AdapterUpdate version {update.version} was published before with other "
                                     f"weights (sha256 {latest_sha[:12]}...); a version number is never reused: "
                                     f"publish version {latest + 1} or later")
        if update.version <= latest and not restoring:
            return "stale_version", (f"AdapterUpdate version {update.version} does not advance the latest version "
                                     f"{latest}; publish version {latest + 1} or later")
        try:
            self.adapters.verify(update, frames)
        except ProtocolError as exc:
            return exc.code, str(exc)
        return None

    def publish(self, identity: bytes, peer: Peer, update: protocol.AdapterUpdate, envelope: framing.Envelope,
                frames: list[Any]) -> StoredAdapter:
        """Keep a checked AdapterUpdate as the latest version; Ack (after the state write) and notices queued."""
        restoring = self._restoring(update)
        stored = self.adapters.add(update, envelope.specs, frames, verified=True)
        self.progress.latest_version, self.progress.latest_sha256 = update.version, update.sha256.lower()
        peer.adapter_version = update.version
        self._unsaved = (update.version, stored.message)
        self.outbox.send_record(identity, protocol.AdapterAck(version=update.version), after_durable=True)
        notice = codec.encode(stored.notice())  # encoded once for every worker (the core paces the sends)
        self.outbox.send_to_all([worker.identity for worker in self.peers.of_role("worker")], Kind.ADAPTER_NOTICE,
                                notice)
        self.stats.count("adapters", "restored" if restoring else "published")
        log.info("adapter_published", version=update.version, step=update.step, num_bytes=stored.num_bytes,
                 num_tensors=stored.num_tensors, restored=restoring)
        return stored

    def fetch(self, identity: bytes, fetch: protocol.AdapterFetch) -> str | None:
        """Send the requested version's frames; the Error message when it is not kept."""
        stored = self.adapters.get(fetch.version)
        if stored is None:
            have = (f"kept: {[a['version'] for a in self.adapters.snapshot()]}" if self.adapters.newest
                    else "none published yet")
            return (f"adapter version {fetch.version or 'newest'} is not kept ({have}; latest version "
                    f"{self.progress.latest_version})")
        self.outbox.send(identity, Kind.ADAPTER_UPDATE, stored.message)
        return None

    def notify_behind(self, identity: bytes, adapter_version: int) -> None:
        """A worker's Hello with an older version: a notice of the newest (it fetches when it wants it)."""
        newest = self.adapters.newest
        if newest is not None and adapter_version < newest.version:
            self.outbox.send_record(identity, newest.notice())

    def withdraw(self, lo: int, hi: int) -> None:
        self.stats.count("adapters", "withdrawn", len(self.adapters.withdraw(lo, hi)))


class NoticePacer:
    """The AdapterNotices queued for a later batch, and when the next batch may go."""

    def __init__(self) -> None:
        self._queued: deque[Outgoing] = deque()
        self._next_s = 0.0

    def __len__(self) -> int:
        return len(self._queued)

    def due(self, now_s: float) -> bool:
        """Notices are queued and their next batch may go now."""
        return bool(self._queued) and now_s >= self._next_s

    def next_due_s(self) -> float | None:
        """When the next batch may go (None: nothing queued)."""
        return self._next_s if self._queued else None

    def spread(self, out: list[Outgoing], now_s: float) -> list[Outgoing]:
        """``out`` with its AdapterNotices queued behind earlier ones, and, when a batch is due, at most
        NOTICE_BATCH of those appended."""
        if not self._queued and not any(o.kind == Kind.ADAPTER_NOTICE for o in out):
            return out
        queued = self._queued
        kept = []
        for o in out:
            (queued.append if o.kind == Kind.ADAPTER_NOTICE else kept.append)(o)
        if now_s >= self._next_s:
            batch = min(NOTICE_BATCH, len(queued))
            kept.extend(queued.popleft() for _ in range(batch))
            # a full batch may have more behind it: the next waits; after a partial one the queue is short
            self._next_s = now_s + NOTICE_SPACING_S if batch == NOTICE_BATCH else now_s
        return kept

    def take_all(self) -> list[Outgoing]:
        """Every queued notice, now (shutting down: they are older than anything the outbox holds)."""
        pending = list(self._queued)
        self._queued.clear()
        return pending
