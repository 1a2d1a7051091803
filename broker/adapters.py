"""The adapter relay's memory: the newest published adapter versions, kept as the frames that arrived.

The learner publishes an AdapterUpdate (PEFT tensor names, dtypes, shapes, sha256 over the tensor frames in
order, :func:`loraflow.common.framing.frames_sha256`). The broker checks the digest once, reading the frames in place
(``hashlib`` over memoryviews, no copy), then keeps the *whole received message* — preamble, header and tensor frames — and forwards it
unchanged to every worker that fetches it: re-sending a ``zmq.Frame`` shares its buffer, so sixteen workers
fetching a 50 MB adapter cost no extra 50 MB copies in the broker. The newest ``num_kept`` versions are
kept (workers a little behind can still fetch the version they ask for); older ones are released, and versions
a restarted learner rolled back are forgotten at once (:meth:`AdapterCache.withdraw`).

Pure logic apart from hashing: no sockets.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loraflow.common import framing
from loraflow.common.framing import TensorSpec
from loraflow.common.protocol import AdapterNotice, AdapterUpdate, ProtocolError


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
