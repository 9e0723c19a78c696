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
    delta: bool = False  # it got the version as a delta against the version it held
    relayed_by: str | None = None  # the subscriber on its host it copied the version from (None: pushed to it)


@dataclass(frozen=True)
class DeltaStats:
    """What the diff of one version found (publishers with delta sync on).

    Attributes:
        base: the version it was diffed against (None: no base, every subscriber got it dense).
        changed: elements that differ from the base, over the tensors that can travel as deltas.
        elements: elements of those tensors.
        dense_bytes: bytes of the dense version.
        delta_bytes: bytes a subscriber holding the base received (``dense_bytes`` when no
            tensor was worth a delta).
        encode_s: the diff + encode pass (part of ``pack_s``).
        kinds: how many tensors went ``unchanged``, ``varint``, ``bitmask`` or ``dense``.
        sampled: the version went dense without a full diff because a sample of the change said
            a delta would not pay (``changed``/``elements`` are then the sample's).
        crossover: the changed fraction above which a tensor went dense for this version (the
            publisher's ``delta_crossover``, or the highest it chose per subscriber from its
            measurements); 0.0 when its measurements said no delta would pay on any
            subscriber's path (the version went dense without a sample or a diff; ``base`` is
            then None); None when no subscriber took deltas.
    """

    base: int | None
    changed: int
    elements: int
    dense_bytes: int
    delta_bytes: int
    encode_s: float
    kinds: dict[str, int] = field(default_factory=dict)
    sampled: bool = False
    crossover: float | None = None

    @property
    def density(self) -> float:
        """The changed fraction of the elements (the sample's when ``sampled``; 1.0 without a
        base and a sample)."""
        if self.elements and (self.base is not None or self.sampled):
            return self.changed / self.elements
        return 1.0


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

    The phases are counted so that ``queued_s + pack_s + discover_s + push_s + snapshot_s ==
    total_s``, which runs from the call's entry to its return. Doorbells ring in the background
    after ``push_s`` and take none of it. Two phases overlap others: the lookup of the
    subscribers runs beside the pack and a delta version's diff (``discover_s`` is what it took
    past both), and the pushes of a delta version begin while its diff runs (``push_s`` is what
    they took past it and the lookup).

    Attributes:
        version: the version published.
        results: subscriber name -> :class:`SyncResult`.
        left: subscribers that left since an earlier publish served them (sorted).
        queued_s: waiting for an earlier ``publish`` of this publisher still running, and for
            its background snapshot copy.
        pack_s: packing what cannot go straight from the live tensors (buckets of several small
            tensors, fp8) into the snapshot; with delta sync, the sample and the diff too.
        discover_s: finding the current subscribers in the rendezvous store, past the pack and
            the diff.
        push_s: pushing the version to every subscriber, until the last one was complete,
            failed or hit the deadline (past the diff, for a delta version).
        snapshot_s: completing the snapshot that ``pull()`` reads. When a subscriber got the
            version, the rest of the snapshot is copied from its slot in the background (the
            live tensors may change once ``publish`` returns; that slot does not change before
            the next publish, which waits for the copy, as ``queued_s``): then this is only
            its start. Otherwise the copy from the live tensors, here.
        total_s: the whole call.
        delta: what the diff found, with delta sync on (else None).
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
    delta: DeltaStats | None = None

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
