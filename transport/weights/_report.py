"""What a publish reports: per subscriber, how its copy of the version ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SyncStatus(enum.Enum):
    """How one subscriber's copy of one version ended."""

    DONE = "done"  # every byte and the front are in the subscriber's memory
    STRAGGLER = "straggler"  # not complete within the deadline; caught up by a later publish (or pull)
    FAILED = "failed"  # an error (peer lost, layout mismatch, ...); see ``error``


@dataclass(frozen=True)
class SyncResult:
    """How one subscriber fared in one publish."""

    subscriber: str
    version: int
    status: SyncStatus
    nbytes: int  # bytes written into the subscriber
    seconds: float  # from the start of the publish until this subscriber was complete (or given up)
    error: str | None = None


@dataclass(frozen=True)
class PublishReport:
    """What ``publish`` did, per subscriber."""

    version: int
    seconds: float
    snapshot_seconds: float
    results: dict[str, SyncResult] = field(default_factory=dict)

    def by_status(self, status: SyncStatus) -> list[str]:
        """Names of the subscribers that ended with ``status``, sorted."""
        return sorted(n for n, r in self.results.items() if r.status == status)

    @property
    def done(self) -> list[str]:
        return self.by_status(SyncStatus.DONE)

    @property
    def stragglers(self) -> list[str]:
        return self.by_status(SyncStatus.STRAGGLER)

    @property
    def failed(self) -> list[str]:
        return self.by_status(SyncStatus.FAILED)
