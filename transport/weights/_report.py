"""What a publish reports: per subscriber, how its copy of the version ended, who left, and
where the publish's time went."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SyncStatus(enum.Enum):
    """How one subscriber's copy of one version ended."""

    DONE = "done"  # every byte and the front are in the subscriber's memory
    STRAGGLER = "straggler"  # not complete within the deadline; caught up by a later publish (or pull)
    FAILED = "failed"  # an error (peer lost or died, layout mismatch, ...); see ``error``


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
    """What ``publish`` did, per subscriber, and where its time went.

    ``results`` has one entry per subscriber served, plus one ``FAILED`` entry (a
    ``PeerLostError`` reason) for each subscriber served by an earlier publish that has died
    since (its process exited, or this Transport declared it lost). A dead subscriber is
    reported once, by the first publish that finds it dead; later publishes leave it out (a
    restarted process under the same name is a new subscriber). ``left`` names the subscribers
    served by an earlier publish that have left on their own since (they unsubscribed or closed
    their Transport), also once.

    The phases follow one another, so ``queued_s + pack_s + discover_s + push_s + snapshot_s ==
    total_s``, which runs from the call's entry to its return. Doorbells ring in the background
    after ``push_s`` and take none of it.

    Attributes:
        version: the version published.
        results: subscriber name -> :class:`SyncResult`.
        left: subscribers that left since an earlier publish served them (sorted).
        queued_s: waiting for an earlier ``publish`` of this publisher still running, and for
            its background snapshot copy.
        pack_s: packing what cannot go straight from the live tensors (buckets of several small
            tensors, fp8) into the snapshot.
        discover_s: finding the current subscribers in the rendezvous store.
        push_s: pushing the version to every subscriber, until the last one was complete,
            failed or hit the deadline.
        snapshot_s: completing the snapshot that ``pull()`` reads. When a subscriber got the
            version, the rest of the snapshot is copied from its slot in the background (the
            live tensors may change once ``publish`` returns; that slot does not change before
            the next publish, which waits for the copy, as ``queued_s``): then this is only
            its start. Otherwise the copy from the live tensors, here.
        total_s: the whole call.
    """

    version: int
    results: dict[str, SyncResult] = field(default_factory=dict)
    left: tuple[str, ...] = ()
    queued_s: float = 0.0
    pack_s: float = 0.0
    discover_s: float = 0.0
    push_s: float = 0.0
    snapshot_s: float = 0.0
    total_s: float = 0.0

    @property
    def phases(self) -> dict[str, float]:
        """The phase times by name, in order; they sum to ``total_s``."""
        return {"queued_s": self.queued_s, "pack_s": self.pack_s, "discover_s": self.discover_s,
                "push_s": self.push_s, "snapshot_s": self.snapshot_s}

    @property
    def seconds(self) -> float:
        """The whole call (``total_s``)."""
        return self.total_s

    @property
    def snapshot_seconds(self) -> float:
        """The packing before the pushes (``pack_s``; the name of earlier releases)."""
        return self.pack_s

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
