"""What the learner has trained, as the broker vouches for it: where the run stands, what a learner
checkpoint covers, and what was rolled back.

:class:`RunProgress` is where the run stands: the newest policy version and how much has been trained. It is
shared by the core and the desks that decide with it (:mod:`loraflow.broker.leasing`'s admission,
:mod:`loraflow.broker.batching`'s staleness checks); the handlers are its only writers: an AdapterUpdate moves
``latest_version``, a BatchAck the trained counts, a restarted learner's rollback both. ``latest_version``,
``latest_sha256`` and ``num_trained_total`` are persisted (:mod:`loraflow.broker.state`); ``base_version`` and
``num_trained_since_start`` are the admission limit's counting base
(:func:`loraflow.common.versions.admission_limit`), from this process's start.

:class:`TrainingHistory` is what a restarted learner is reconciled with. The learner acknowledges a batch
right after the step that trained it, but makes those steps durable only every ``learner.checkpoint_every``
steps. A learner that dies loses the steps after its last checkpoint, so "trained" (acknowledged) is not yet
"committed" (in the weights a restarted learner resumes from). The broker keeps what it needs to undo the
difference::

    BatchAck(trained_version=t, checkpoint_version=c)
        -> record(key, t) for every group it marks trained       (uncommitted: key -> t, in training order)
        -> commit(c): drop records with t < c                     (a checkpoint of version c holds every step
                                                                   that trained parameters of a version < c)
    Hello from a learner of another session, at version v        (it resumed from a checkpoint of version v)
        -> rollback(v): the records with t >= v, removed          (the broker re-queues their prompts)
        -> withdraw(v + 1, latest_version)                        (versions published after that checkpoint)

``commit`` is exact when the learner publishes after every step (``learner.publish_every = 1``: the step that
trained version t produced t + 1) and errs on the safe side otherwise: a group the checkpoint does hold may be
re-queued, and the resumed learner then skips it as ``already_trained`` (its checkpoint keeps the trained ids)
and acknowledges it again; a group it does not hold is never taken for committed.

Records are kept in training order (versions never decrease within a learner session), so :meth:`commit` pops
from the front. They are bounded by ``max_records`` (the core sizes it to twice the groups of a checkpoint
interval plus the buffer): a learner that never reports a checkpoint cannot grow the broker's memory or state
file without bound; the oldest records then go (counted, ``overflow``), and a restart of such a learner could
not re-queue what it lost that far back. Records are not kept at all when the learner does not checkpoint
(``learner.checkpoint_every = 0``): it restarts from the base model, and re-training the whole history is not
a recovery.

Withdrawn versions are inclusive ranges (:mod:`loraflow.common.versions`). Their numbers are never used again, and no
group holding a token generated under one of them is buffered, served or trained. All of it is persisted in
the state file (:mod:`loraflow.broker.state`), so a broker restart between a learner's death and its recovery loses
nothing. Pure logic: no sockets, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from loraflow.broker.prompts import PromptKey
from loraflow.common import versions
from loraflow.common.versions import VersionRange


@dataclass(slots=True, kw_only=True)
class RunProgress:
    latest_version: int = 0  # the newest adapter version published
    latest_sha256: str = ""  # its tensors' checksum (a version number is never reused with other weights)
    base_version: int = 0  # the admission limit counts versions trained from here
    num_trained_total: int = 0  # groups trained over the run's lifetime (persisted)
    num_trained_since_start: int = 0  # groups trained since base_version
    mean_group_bytes: float = 0.0  # running mean size of an accepted group (0 before the first)
    draining: bool = False  # shutting down: no more leases
    learner: dict[str, int] = field(default_factory=dict)  # the learner's last reported step and versions

    def trained(self, num_groups: int) -> None:
        """``num_groups`` more groups trained (negative: rolled back)."""
        self.num_trained_total += num_groups
        self.num_trained_since_start += num_groups

    def group_accepted(self, num_bytes: int) -> None:
        weight = 0.1 if self.mean_group_bytes else 1.0
        self.mean_group_bytes += weight * (num_bytes - self.mean_group_bytes)


class TrainingHistory:
    """Uncommitted trained groups, the learner session they belong to, and the withdrawn version ranges."""

    def __init__(self, *, max_records: int, learner_session: str = "",
                 uncommitted: Iterable[tuple[PromptKey, int]] = (), withdrawn: Iterable[VersionRange] = ()) -> None:
        self.max_records = max_records
        self.num_overflowed = 0
        self.learner_session = learner_session
        self.uncommitted: OrderedDict[PromptKey, int] = OrderedDict(uncommitted)
        self.withdrawn: list[VersionRange] = []
        for lo, hi in withdrawn:
            self.withdrawn = versions.withdraw(self.withdrawn, lo, hi)

    def record(self, key: PromptKey, trained_version: int) -> None:
        """A group was trained on parameters of ``trained_version`` (acknowledged, not yet checkpointed)."""
        if self.max_records <= 0:
            return
        self.uncommitted.pop(key, None)
        self.uncommitted[key] = trained_version
        while len(self.uncommitted) > self.max_records:
            self.uncommitted.popitem(last=False)
            self.num_overflowed += 1

    def commit(self, checkpoint_version: int) -> int:
        """A learner checkpoint of ``checkpoint_version`` is durable; returns how many records it settled."""
        settled = 0
        while self.uncommitted and next(iter(self.uncommitted.values())) < checkpoint_version:
            self.uncommitted.popitem(last=False)
            settled += 1
        return settled

    def rollback(self, resumed_version: int) -> list[PromptKey]:
        """Remove and return the groups a learner resumed at ``resumed_version`` no longer holds."""
        lost = [k for k, t in self.uncommitted.items() if t >= resumed_version]
        for key in lost:
            del self.uncommitted[key]
        self.uncommitted.clear()  # the rest is in the checkpoint it resumed from
        return lost

    def withdraw(self, lo: int, hi: int) -> bool:
        """Withdraw versions lo..hi; returns True if anything new was withdrawn."""
        merged = versions.withdraw(self.withdrawn, lo, hi)
        changed = merged != self.withdrawn
        self.withdrawn = merged
        return changed

    def is_withdrawn(self, version: int) -> bool:
        return versions.is_withdrawn(self.withdrawn, version)

    def snapshot(self) -> dict[str, object]:
        return {"uncommitted_groups": len(self.uncommitted), "withdrawn": [list(r) for r in self.withdrawn],
                "learner_session": self.learner_session}
