"""The lease table: which worker holds which prompt, until when.

A lease gives one prompt (x group_size samples) to one worker with a deadline (``broker.lease_timeout_s``
from the grant). The holder's heartbeats name the leases it is still working on and each pushes their
deadlines back to ``lease_timeout_s`` from then (:meth:`LeaseTable.renew`), so a generation that takes longer
than the timeout is not handed out a second time, while a dead or silent worker's leases still come back
within ``lease_timeout_s`` of its last heartbeat. A lease ends in one of four ways, each handled by the server:

- the worker submits the group (:meth:`LeaseTable.pop`), or gives it back with a LeaseReturn;
- the deadline passes (:meth:`LeaseTable.expired`, the prompt is re-queued);
- the worker dies or re-registers with a new session (:meth:`LeaseTable.reclaim`, re-queued at once);
- a group for the same prompt arrives from an older, expired lease (:meth:`LeaseTable.cancel_key`): the
  late group is accepted, and the newer lease's later submit becomes a duplicate.

At most one lease exists per prompt, and a worker holds at most ``max_per_worker`` at once. Pure logic: no
sockets, no clock of its own (callers pass ``now_s``, a ``time.monotonic()`` reading).

A lease is bound to its holder: its id ends in a MAC (HMAC-SHA256 under the run's ``secret``, kept in the
broker's state file) over the id, the prompt and the holder's identity, so :meth:`LeaseTable.issued_to` can
tell, also after the lease ended and after a broker restart, whether a lease id was really granted to this
client for this prompt: a client cannot submit for another client's lease or for a made-up lease id.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from loraflow.broker.peers import display_name
from loraflow.broker.prompts import PromptKey


@dataclass(slots=True, kw_only=True)
class Lease:
    lease_id: str
    key: PromptKey
    worker: bytes  # the holder's zmq identity
    granted_s: float
    deadline_s: float


class LeaseTable:
    """Leases by id, by prompt and by worker, with deadlines kept in a heap."""

    def __init__(self, *, timeout_s: float, max_per_worker: int, id_prefix: str = "L", secret: bytes = b"") -> None:
        if timeout_s <= 0 or max_per_worker < 1:
            raise ValueError(f"lease timeout_s must be > 0 and max_per_worker >= 1, got {timeout_s}, {max_per_worker}")
        self.timeout_s = timeout_s
        self.max_per_worker = max_per_worker
        self._prefix = id_prefix
        self._secret = secret
        self._ids = itertools.count(1)
        self._by_id: dict[str, Lease] = {}
        self._by_key: dict[PromptKey, str] = {}
        self._by_worker: dict[bytes, set[str]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self.num_granted = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._by_id

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_id.values()))

    def get(self, lease_id: str) -> Lease | None:
        return self._by_id.get(lease_id)

    def of_key(self, key: PromptKey) -> Lease | None:
        lease_id = self._by_key.get(key)
        return None if lease_id is None else self._by_id[lease_id]

    def count(self, worker: bytes) -> int:
        return len(self._by_worker.get(worker, ()))

    def room(self, worker: bytes) -> int:
        """Leases this worker may still take."""
        return max(0, self.max_per_worker - self.count(worker))

    def of_worker(self, worker: bytes) -> list[Lease]:
        return [self._by_id[i] for i in sorted(self._by_worker.get(worker, ()))]

    def grant(self, key: PromptKey, worker: bytes, now_s: float) -> Lease:
        assert key not in self._by_key, f"prompt {key} is already leased"
        assert self.room(worker) > 0, "per-worker lease limit"
        serial = f"{self._prefix}{next(self._ids)}"
        lease = Lease(lease_id=f"{serial}.{self._mac(serial, key, worker)}", key=key, worker=worker,
                      granted_s=now_s, deadline_s=now_s + self.timeout_s)
        self._by_id[lease.lease_id] = lease
        self._by_key[key] = lease.lease_id
        self._by_worker.setdefault(worker, set()).add(lease.lease_id)
        heapq.heappush(self._deadlines, (lease.deadline_s, lease.lease_id))
        self.num_granted += 1
        return lease

    def _mac(self, serial: str, key: PromptKey, worker: bytes) -> str:
        message = b"%s|%d:%d|%s" % (serial.encode(), key[0], key[1], worker)
        return hmac.digest(self._secret, message, "sha256").hex()[:24]  # (one-shot: OpenSSL's fast path)

    def issued_to(self, lease_id: str, key: PromptKey, worker: bytes) -> bool:
        """Whether ``lease_id`` was granted to ``worker`` for ``key`` (live or ended, by this run's secret)."""
        serial, _, mac = lease_id.rpartition(".")
        return bool(serial) and hmac.compare_digest(mac.encode(), self._mac(serial, key, worker).encode())

    def pop(self, lease_id: str) -> Lease | None:
        """Remove a lease (submitted, returned, undeliverable); None if unknown."""
        lease = self._by_id.pop(lease_id, None)
        if lease is None:
            return None
        del self._by_key[lease.key]
        held = self._by_worker[lease.worker]
        held.discard(lease_id)
        if not held:
            del self._by_worker[lease.worker]
        return lease

    def renew(self, worker: bytes, lease_ids: list[str], now_s: float) -> int:
        """Push back to ``now_s + timeout_s`` the deadline of each listed lease that ``worker`` holds (ids of other
        holders, ended or made-up leases are ignored); returns how many were renewed."""
        held = self._by_worker.get(worker)
        if not held:
            return 0
        deadline_s = now_s + self.timeout_s
        renewed = 0
        for lease_id in set(lease_ids) & held:
            lease = self._by_id[lease_id]
            if deadline_s > lease.deadline_s:
                lease.deadline_s = deadline_s
                heapq.heappush(self._deadlines, (deadline_s, lease_id))  # the older entry is skipped by expired()
                renewed += 1
        return renewed

    def cancel_key(self, key: PromptKey) -> Lease | None:
        """Remove whatever lease is on this prompt (a group for it arrived by another route)."""
        lease_id = self._by_key.get(key)
        return None if lease_id is None else self.pop(lease_id)

    def expired(self, now_s: float) -> list[Lease]:
        """Remove and return the leases whose deadline has passed."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._by_id.get(lease_id)
            if lease is not None and lease.deadline_s <= now_s:
                out.append(self.pop(lease_id))
        if len(self._deadlines) > 4 * len(self._by_id) + 64:  # drop entries of leases that ended early
            self._deadlines = [(d, i) for d, i in self._deadlines if i in self._by_id]
            heapq.heapify(self._deadlines)
        return out

    def reclaim(self, worker: bytes) -> list[Lease]:
        """Remove and return every lease a worker holds (it died or restarted)."""
        return [lease for lease in (self.pop(i) for i in sorted(self._by_worker.get(worker, ()))) if lease]

    def next_deadline_s(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._by_id:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def snapshot(self, now_s: float) -> list[dict]:
        return [{"lease_id": lease.lease_id, "group_id": f"{lease.key[0]}:{lease.key[1]}",
                 "worker": display_name(lease.worker), "age_s": round(now_s - lease.granted_s, 3),
                 "expires_in_s": round(lease.deadline_s - now_s, 3)} for lease in self._by_id.values()]
