"""The group ledger: the one owner of every prompt's and group's life, from its first lease to its training.

Each prompt key ``(epoch, index)`` is in exactly one state, and every change of state is one row of
:data:`RULES`: a reason, the states it may start from, the state it ends in, and the counter it bumps::

    new --granted--> leased --accepted--> buffered --served--> training --trained--> trained
                       |  ^                  |   ^                 |                   |
      expired/returned/|  |granted   stale/  |   |restored         | not_trained/      | rolled_back
      reclaimed/refused/  |          withdrawn/  +-----------------+ policy_mismatch   |
      undeliverable/   v  |          policy_mismatch               v                   v
      quarantined     queued <-------------+---------------------- queued <------------+
                    (also: queued --accepted--> buffered: a late group of an expired lease;
                     any pending state --trained_unserved--> trained: a BatchAck from before a broker restart)

What a state holds lives in one store each, and only the ledger writes to them: the state table, the cursor
and the re-queue order (:class:`loraflow.broker.prompts.PromptSource`), the lease of a leased prompt
(:class:`loraflow.broker.prompts.LeaseTable`) and the frames of a buffered or training group
(:class:`loraflow.broker.buffer.RolloutBuffer`, which enforces the capacity and byte bounds). Everything else the
broker reports or persists is read from here: lease counts, buffer contents and bytes, the prompt counts of a
Stats reply, and the persisted ``cursor`` / ``reserved_until`` / ``pending`` (:meth:`GroupLedger.restored`
rebuilds a ledger from them: every pending key and every key of the reserved block is queued again, a trained
key never is, so each prompt is trained exactly once across restarts). :meth:`GroupLedger.check` verifies
that the stores agree; the property tests (tests/broker/test_ledger.py) run it after every event.

Pure logic: no sockets, no clock (callers pass ``now_s``); counters go to the ``count(family, event, n)``
callable it is given (the broker's :class:`loraflow.broker.stats.BrokerStats`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loraflow.broker.buffer import RolloutBuffer, StoredGroup
from loraflow.broker.prompts import Lease, LeaseTable, PromptKey, PromptSource, group_id_of
from loraflow.common.versions import StalenessRule


class State(enum.StrEnum):
    NEW = "new"  # at or past the cursor: never issued
    QUEUED = "queued"
    LEASED = "leased"
    BUFFERED = "buffered"
    TRAINING = "training"
    TRAINED = "trained"


class Reason(enum.StrEnum):
    """Why a prompt changed state: one row of :data:`RULES` each."""

    GRANTED = "granted"
    EXPIRED = "expired"
    RETURNED = "returned"
    RECLAIMED = "reclaimed"
    REFUSED = "refused"
    UNDELIVERABLE = "undeliverable"
    QUARANTINED = "quarantined"
    ACCEPTED = "accepted"
    SERVED = "served"
    RESTORED = "restored"
    TRAINED = "trained"
    TRAINED_UNSERVED = "trained_unserved"
    NOT_TRAINED = "not_trained"
    POLICY_MISMATCH = "policy_mismatch"
    STALE = "stale"
    WITHDRAWN = "withdrawn"
    ROLLED_BACK = "rolled_back"


@dataclass(frozen=True, slots=True)
class Rule:
    sources: frozenset[State]
    target: State
    counter: tuple[str, str] | None  # (stats family, event) bumped once per prompt moved


def _rule(sources: Iterable[State], target: State, counter: tuple[str, str] | None) -> Rule:
    return Rule(frozenset(sources), target, counter)


S = State
PENDING = (S.QUEUED, S.LEASED, S.BUFFERED, S.TRAINING)
RULES: dict[Reason, Rule] = {
    Reason.GRANTED: _rule([S.NEW, S.QUEUED], S.LEASED, ("leases", "granted")),
    Reason.EXPIRED: _rule([S.LEASED], S.QUEUED, ("leases", "expired")),
    Reason.RETURNED: _rule([S.LEASED], S.QUEUED, ("leases", "returned")),
    Reason.RECLAIMED: _rule([S.LEASED], S.QUEUED, ("leases", "reclaimed")),
    Reason.REFUSED: _rule([S.LEASED], S.QUEUED, ("leases", "refused")),
    Reason.UNDELIVERABLE: _rule([S.LEASED], S.QUEUED, ("leases", "undeliverable")),
    Reason.QUARANTINED: _rule([S.LEASED], S.QUEUED, ("leases", "quarantined")),
    Reason.ACCEPTED: _rule([S.QUEUED, S.LEASED], S.BUFFERED, ("groups", "accepted")),
    Reason.SERVED: _rule([S.BUFFERED], S.TRAINING, ("groups", "served")),
    Reason.RESTORED: _rule([S.TRAINING], S.BUFFERED, ("groups", "restored")),
    Reason.TRAINED: _rule([S.TRAINING], S.TRAINED, ("groups", "trained")),
    Reason.TRAINED_UNSERVED: _rule(PENDING, S.TRAINED, ("groups", "trained")),
    Reason.NOT_TRAINED: _rule([S.TRAINING], S.QUEUED, ("dropped", "not_trained")),
    Reason.POLICY_MISMATCH: _rule([S.TRAINING, S.BUFFERED], S.QUEUED, ("dropped", "policy_mismatch")),
    Reason.STALE: _rule([S.BUFFERED], S.QUEUED, ("dropped", "stale")),
    Reason.WITHDRAWN: _rule([S.BUFFERED], S.QUEUED, ("dropped", "withdrawn")),
    Reason.ROLLED_BACK: _rule([S.TRAINED], S.QUEUED, None),  # counted per rollback, with the lost records
}
_STATES = {str(s): s for s in State}
#: lease endings: the prompt goes back to the queue
LEASE_ENDINGS = frozenset(r for r, rule in RULES.items() if rule.sources == {S.LEASED} and rule.target is S.QUEUED)


def _ignore(_family: str, _event: str, _amount: int = 1) -> None:
    pass


class GroupLedger:
    """Every prompt's state, its lease and its group; the only writer of the three (see the module docstring)."""

    def __init__(self, source: PromptSource, *, buffer: RolloutBuffer, leases: LeaseTable,
                 count: Callable[..., None] = _ignore) -> None:
        # the three stores, readable by anyone (plain attributes: read on every message), written only here
        self.source = source  # the cursor, the state table and the re-queue order
        self.buffer = buffer  # the frames of buffered and training groups
        self.leases = leases  # the lease of each leased prompt
        self._count = count
        self.num_changes = 0  # transitions so far: a change means parked long-polls may be answerable
        # which token of a group decides that it is too stale, on arrival (loraflow.broker.groups) and in the buffer
        self.staleness_rule = StalenessRule.NEWEST_TOKEN

    @classmethod
    def restored(cls, task_source: Callable[..., PromptSource], *, cursor: PromptKey, reserved_until: PromptKey,
                 pending: Iterable[PromptKey], num_epochs: int, **kwargs) -> GroupLedger:
        """The ledger of a restarted broker from what the previous one persisted: every pending key and every key
        of the reserved block queued again (a key issued after the last write is inside the block), the cursor
        after the block. ``task_source(cursor=..., requeued=...)`` builds the prompt source."""
        probe = task_source()
        requeued = sorted(set(pending) | set(probe.keys_between(cursor, reserved_until)))
        requeued = [k for k in requeued if not num_epochs or k[0] < num_epochs]
        return cls(task_source(cursor=reserved_until, requeued=requeued), **kwargs)

    # -- views -----------------------------------------------------------------------------------------------

    def state(self, key: PromptKey) -> State:
        return _STATES[self.source.state(key)]

    @property
    def num_queued(self) -> int:
        return self.source.num_queued

    @property
    def num_leased(self) -> int:
        return len(self.leases)

    @property
    def num_held(self) -> int:
        """Buffered + training groups."""
        return self.buffer.num_groups

    def pending_keys(self) -> list[PromptKey]:
        return self.source.pending_keys()

    def buffered(self) -> list[StoredGroup]:
        return self.buffer.buffered()

    def batch_ids(self) -> list[str]:
        return self.buffer.batch_ids()

    def available(self, limit: int) -> int:
        return self.source.available(limit)

    def nothing_more_to_come(self) -> bool:
        """Every epoch is issued and nothing is queued or leased: the buffer holds the last groups there will be."""
        return self.source.exhausted() and self.source.num_queued == 0 and len(self.leases) == 0

    def snapshot(self) -> dict[str, int]:
        return self.source.snapshot()

    # -- transitions -----------------------------------------------------------------------------------------

    def _move(self, key: PromptKey, reason: Reason, old: State | None = None, count: bool = True) -> None:
        """Apply one row of RULES to ``key`` (``old``: its state, when the caller's store already says it; the
        property tests check that the stores agree; ``count=False``: the caller counts a batch of moves at once)."""
        rule = RULES[reason]
        old = self.state(key) if old is None else old
        assert old in rule.sources, f"prompt {group_id_of(key)}: {reason} from {old}"
        target = rule.target
        if target is S.QUEUED:
            self.source.requeue(key)
        elif target is S.TRAINED:
            self.source.mark_trained(key)
        else:
            self.source.set_state(key, target)
        if count and rule.counter is not None:
            self._count(*rule.counter)
        self.num_changes += 1

    def _counted(self, reason: Reason, num_moves: int) -> None:
        counter = RULES[reason].counter
        if counter is not None and num_moves:
            self._count(*counter, num_moves)

    def grant(self, worker: bytes, now_s: float) -> Lease | None:
        """The next prompt (re-queued first), leased to ``worker``; None when there is none to lease."""
        key = self.source.next()  # the table says "leased" already (new or queued before)
        if key is None:
            return None
        lease = self.leases.grant(key, worker, now_s)
        self._count("leases", "granted")
        self.num_changes += 1
        return lease

    def end_lease(self, lease: Lease, reason: Reason) -> bool:
        """A live lease ends without a group (its prompt re-queued); False if it had ended already."""
        assert reason in LEASE_ENDINGS, reason
        if self.leases.get(lease.lease_id) is not lease:
            return False
        self.leases.pop(lease.lease_id)
        self._move(lease.key, reason)
        return True

    def end_leases_of(self, worker: bytes, reason: Reason) -> list[Lease]:
        """End every lease ``worker`` holds (it died, restarted or was quarantined)."""
        leases = self.leases.of_worker(worker)
        for lease in leases:
            self.end_lease(lease, reason)
        return leases

    def expire(self, now_s: float) -> list[Lease]:
        """End the leases whose deadline has passed."""
        expired = self.leases.expired(now_s)
        for lease in expired:
            self._move(lease.key, Reason.EXPIRED)
        return expired

    def renew(self, worker: bytes, lease_ids: list[str], now_s: float) -> int:
        return self.leases.renew(worker, lease_ids, now_s)

    def accept(self, group: StoredGroup, lease_id: str, old: State | None = None) -> Lease | None:
        """Buffer the group of a queued or leased prompt; whatever lease is on the prompt ends (the one it was
        generated for: submitted; a newer one of a prompt whose lease had expired: cancelled) and is returned.
        The caller has checked :meth:`RolloutBuffer.fits` (a group that does not fit raises); ``old``: the
        prompt's state, when the caller has just read it."""
        old = self.state(group.key) if old is None else old
        self.buffer.add(group)
        lease = self.leases.cancel_key(group.key)
        if lease is not None:
            self._count("leases", "submitted" if lease.lease_id == lease_id else "cancelled")
        self._move(group.key, Reason.ACCEPTED, old=old)
        return lease

    def serve(self, num_groups: int, batch_id: str) -> list[StoredGroup] | None:
        """The ``num_groups`` oldest buffered groups, now training in ``batch_id``; None if fewer are buffered."""
        groups = self.buffer.serve(num_groups, batch_id)
        for group in groups or ():
            self._move(group.key, Reason.SERVED, old=S.BUFFERED, count=False)
        self._counted(Reason.SERVED, len(groups or ()))
        return groups

    def unserve(self, batch_id: str) -> list[StoredGroup]:
        """A served batch back to the buffer, in arrival order (the send failed, or the learner is gone)."""
        groups = self.buffer.unserve(batch_id)
        for group in groups:
            self._move(group.key, Reason.RESTORED, old=S.TRAINING)
        return groups

    def unserve_all(self) -> list[StoredGroup]:
        return [g for batch_id in self.buffer.batch_ids() for g in self.unserve(batch_id)]

    def settle(self, batch_id: str, trained: set[str], failed: set[str]) -> list[tuple[StoredGroup, bool]] | None:
        """The learner's BatchAck of a batch this broker served: the groups in ``trained`` are trained, the others
        re-queued (``failed`` ones as policy_mismatch); ``(group, was_trained)`` per group, None for an unknown
        batch id."""
        groups = self.buffer.ack(batch_id)
        if groups is None:
            return None
        out = []
        for group in groups:
            done = group.group_id in trained
            reason = Reason.TRAINED if done else Reason.POLICY_MISMATCH if group.group_id in failed \
                else Reason.NOT_TRAINED
            self._move(group.key, reason, old=S.TRAINING, count=not done)
            out.append((group, done))
        self._counted(Reason.TRAINED, sum(done for _, done in out))
        return out

    def mark_trained(self, key: PromptKey) -> bool:
        """A group trained from a batch this broker did not serve (it restarted): whatever the prompt holds goes;
        True if it was pending."""
        old = self.state(key)
        if old not in PENDING:
            return False
        self.buffer.discard(group_id_of(key))
        if self.leases.cancel_key(key) is not None:
            self._count("leases", "cancelled")
        self._move(key, Reason.TRAINED_UNSERVED, old=old)
        return True

    def drop_buffered(self, groups: list[StoredGroup], reason: Reason) -> None:
        """Take these buffered groups out (stale, withdrawn, or from a quarantined process); prompts re-queued."""
        for group in groups:
            assert self.buffer.state_of(group.group_id) == "buffered", group.group_id
            self.buffer.discard(group.group_id)
            self._move(group.key, reason)

    def drop_stale(self, latest_version: int, max_staleness: int) -> list[StoredGroup]:
        """Buffered groups past the bound under :attr:`staleness_rule`, dropped; prompts re-queued."""
        stale = self.buffer.drop_stale(latest_version, max_staleness, self.staleness_rule)
        for group in stale:
            self._move(group.key, Reason.STALE, old=S.BUFFERED)
        return stale

    def drop_from(self, worker: str, session: str) -> list[StoredGroup]:
        """The buffered groups of one (quarantined) worker process, dropped; training ones are the learner's."""
        gone = [g for g in self.buffer.buffered() if (g.worker, g.session) == (worker, session)]
        self.drop_buffered(gone, Reason.POLICY_MISMATCH)
        return gone

    def roll_back(self, key: PromptKey) -> bool:
        """A trained prompt whose training a restarted learner lost: queued again; False if it is not trained."""
        if self.state(key) is not S.TRAINED:
            return False
        self._move(key, Reason.ROLLED_BACK)
        return True

    # -- invariants ------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert that the stores agree (tests call it after every event; cost O(pending))."""
        source, buffer, leases = self.source, self.buffer, self.leases
        by_state: dict[str, set[PromptKey]] = {s: set() for s in PENDING}
        for key, state in source.states.items():
            by_state[state].add(key)
        assert {s: len(k) for s, k in by_state.items()} == {s: source.counts[s] for s in PENDING}
        assert {lease.key for lease in leases} == by_state[S.LEASED] and len(leases) == len(by_state[S.LEASED])
        assert {g.key for g in buffer.buffered()} == by_state[S.BUFFERED]
        training = {g.key for b in buffer.batch_ids() for g in buffer.batch(b)}
        assert training == by_state[S.TRAINING] and buffer.num_training == len(training)
        assert buffer.num_groups <= buffer.max_groups
        assert buffer.num_groups <= 1 or buffer.memory_bytes <= buffer.max_bytes
        assert buffer.buffered_bytes == sum(g.num_bytes for g in buffer.buffered())
        assert all(key < source.cursor for key in source.states)
