"""Where the run stands, as the broker sees it: the newest policy version and how much has been trained.

One :class:`RunProgress` is shared by the core and the desks that decide with it (:mod:`loraflow.broker.leasing`'s
admission, :mod:`loraflow.broker.batching`'s staleness checks); the core's handlers are the only writers: an
AdapterUpdate moves ``latest_version``, a BatchAck the trained counts, a restarted learner's rollback both.
``latest_version``, ``latest_sha256`` and ``num_trained_total`` are persisted (:mod:`loraflow.broker.state`);
``base_version`` and ``num_trained_since_start`` are the admission limit's counting base
(:func:`loraflow.common.versions.admission_limit`), from this process's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
