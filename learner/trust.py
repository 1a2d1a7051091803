"""Which worker processes the learner's policy check re-scores every time, and which only when audited: the
probation and audit rule of :class:`loraflow.learner.integrity.IntegrityCheck` (why: :mod:`loraflow.common.integrity`).

    a worker process (worker id and Hello session: a restart is a new process) starts on probation
    on probation   every group's chosen samples are re-scored under every version they claim
    trusted        after integrity.probation_groups of its groups passed a comparison in a row (re-scored, or
                   checked from the training forward); its groups' tokens of older versions are re-scored on
                   audited steps only; the version the parameters hold is checked every step (no forward), the
                   evidence of every group every step (no forward)
    audited step   drawn per step with probability integrity.audit_fraction from a keyed hash of (the learner's
                   secret seed, the step's group ids): every rank draws the same, no worker can know which
    a failure      (any reason, any group of the process) puts it back on probation with a count of 0; the broker
                   quarantines it after integrity.quarantine_after failures (loraflow.broker.quarantine)

State: a count per process, the last :data:`MAX_WORKERS` processes seen (one forgotten is on probation again: the
safe side). Every rank updates it from the same verdicts (agreed over the ranks), so every rank holds the same.
A learner restart starts everyone on probation.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

from loraflow.common.logging import get_logger

log = get_logger("learner.trust")

MAX_WORKERS = 4096
_UNIT = float(2**64)


class Trust:
    """Probation counts of the worker processes the check has seen (see the module docstring)."""

    def __init__(self, *, probation_groups: int, audit_fraction: float, seed: int,
                 max_workers: int = MAX_WORKERS) -> None:
        self.probation_groups = probation_groups
        self.audit_fraction = audit_fraction
        self.seed = seed
        self._max_workers = max_workers
        self._passed: collections.OrderedDict[str, int] = collections.OrderedDict()  # process -> passes in a row

    def on_probation(self, process: str) -> bool:
        return self._passed.get(process, 0) < self.probation_groups

    def audited(self, group_ids: Sequence[str]) -> bool:
        """Whether the step of these groups re-scores every worker's older versions (the same on every rank)."""
        if self.audit_fraction >= 1.0:
            return True
        digest = hashlib.blake2b(f"{self.seed}:audit:{','.join(group_ids)}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / _UNIT < self.audit_fraction

    def passed(self, process: str) -> None:
        """One of the process's groups passed a comparison."""
        count = self._passed.get(process, 0) + 1
        self._set(process, count)
        if count == self.probation_groups:
            log.info("integrity_trusted", worker=process, groups_passed=count)

    def failed(self, process: str) -> None:
        """One of the process's groups failed the check: on probation again."""
        if not self.on_probation(process):
            log.warning("integrity_probation", worker=process, reason="a group failed the check")
        self._set(process, 0)

    def num_trusted(self) -> int:
        return sum(count >= self.probation_groups for count in self._passed.values())

    def _set(self, process: str, count: int) -> None:
        self._passed[process] = count
        self._passed.move_to_end(process)
        while len(self._passed) > self._max_workers:
            self._passed.popitem(last=False)
