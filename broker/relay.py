"""The adapter relay: the learner's AdapterUpdates in, checked; notices out to every worker; fetches served.

    AdapterUpdate -> version advances the latest (or restores it: same version, same sha256, frames lost in a
                     broker restart; a withdrawn version never comes back) -> digest -> kept (loraflow.broker.adapters)
                     -> Ack after the state write (the adapter file is written with it) -> AdapterNotice to
                     every worker
    AdapterFetch  -> the kept message's frames, forwarded as received (or Error stale_version: not kept)

:meth:`AdapterRelay.refusal` decides and changes nothing; :meth:`AdapterRelay.publish` applies (see
:mod:`loraflow.broker.dispatch`). A worker behind the newest version learns of it by the notice, or right after its
Welcome, and fetches when it wants it: a reconnect storm moves no tensors.
"""

from __future__ import annotations

from typing import Any

from loraflow.broker.adapters import AdapterCache, StoredAdapter
from loraflow.broker.history import TrainingHistory
from loraflow.broker.outbox import Outbox
from loraflow.broker.peers import Peer, PeerRegistry
from loraflow.broker.progress import RunProgress
from loraflow.broker.stats import BrokerStats
from loraflow.common import framing, protocol
from loraflow.common.logging import get_logger
from loraflow.common.protocol import Kind, ProtocolError

log = get_logger("broker")


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
        notice = protocol.encode(stored.notice())  # encoded once for every worker (the core paces the sends)
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
