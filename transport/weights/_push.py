"""Pushing a version into one subscriber of a stream (:class:`Pushes`): into the slot it is not
about to read, as a delta where it holds the base and a delta pays on its path (each part of
the encodings a start of a prepared put per source, made once per subscriber and slot), else
dense as one prepared transfer, then the front word; into a host's relay, piece by piece, each
logged for the relay's members (:mod:`._relays`). Also what the publisher knows of each
subscriber between versions: its prepared pushes, the slot its last version landed in, whether
it takes deltas and over what link."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio
import torch

from .. import _pieces
from .._errors import LayoutMismatchError, PeerLostError, TransportError
from ._codec.parts import Source
from ._codec.policy import Crossover
from ._control import APPLIED, CTL_WORDS, DELTA, FRONT, LAYOUT_ID, StreamKeys, decode_front, encode_front, free_slot
from ._delta_feed import DeltaFeed
from ._layout import Layout
from ._polling import PENDING, Pending, poll
from ._relay_order import PIECE_BYTES, RELAY_WINDOW
from ._report import SyncResult, SyncStatus

if TYPE_CHECKING:
    from .. import Peer, PreparedTransfer, Transfer, Transport

log = logging.getLogger(__name__)




def pieces(buckets: Sequence[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """Consecutive buckets grouped into pieces of at least ``nbytes`` (the last may be
    smaller): (first, last + 1) bucket indices. Each piece is one prepared transfer, large
    enough for a backend to stripe it over several links, small enough that a relay's members
    follow it closely."""
    out: list[tuple[int, int]] = []
    first, size = 0, 0
    for i, (start, end) in enumerate(buckets):
        size += end - start
        if size >= nbytes:
            out.append((first, i + 1))
            first, size = i + 1, 0
    if first < len(buckets):
        out.append((first, len(buckets)))
    return out


# How often :meth:`Pushes.applied` looks at a subscriber's APPLIED word while it is not there
# yet: after 4 ms, then with a backoff to 8 ms. Each look is a get that the subscriber's process
# serves: looking every millisecond slowed the very applies it waited for on the 2-core VM.
APPLIED_FIRST_S, APPLIED_LONGEST_S = 0.004, 0.008


@dataclass(frozen=True)
class Look:
    """A subscriber's control block as read before a push, and the slot chosen to write."""

    ctl: torch.Tensor
    nslots: int
    back: int


class Log(Protocol):
    """Where a push into a relay logs each part once it is in the relay's memory
    (:class:`._relay_order.RelayLog`)."""

    async def begin(self) -> None: ...

    def follow(self, handle: Transfer, rows: list[tuple[int, int]]) -> None: ...

    async def end(self, delta: bool, nbytes: int) -> None: ...


class Pushes:
    """The pushes of one stream publisher, and what it keeps per subscriber between versions.

    Args:
        transport: the publisher's Transport.
        stream: the stream's name.
        keys: its region names.
        layout: its packed layout.
        source: where a bucket is sent from (``Snapshots.source``: the live tensor's bytes, or
            the snapshot given; the pushes only read them).
        crossover: the publisher's crossover model (told each dense push's time).
        deadline: seconds a push may take (from the end of a delta version's diff).
        index_bytes: the size of a subscriber's delta index region for this layout.
        delta_everywhere: deltas also to subscribers reached over a same-host link.
    """

    def __init__(self, transport: Transport, stream: str, keys: StreamKeys, layout: Layout,
                 source: Callable[[torch.Tensor, int, int], torch.Tensor], crossover: Crossover, deadline: float,
                 index_bytes: int, delta_everywhere: bool) -> None:
        self.t, self.stream, self._keys, self.layout = transport, stream, keys, layout
        self._source, self._crossover, self.deadline = source, crossover, deadline
        self._index_bytes, self._delta_everywhere = index_bytes, delta_everywhere
        self.pieces = pieces(layout.buckets, PIECE_BYTES)  # the parts a push into a relay is logged by
        # (subscriber, incarnation, its slot, our snapshot's address, piece or -1: all) -> the prepared push
        self._batches: dict[tuple[str, str, int, int, int], PreparedTransfer] = {}
        # (subscriber, incarnation, its slot, the source's address) -> the prepared put of every run a
        # delta version's parts may take from that source (started with each part's runs)
        self._deltas: dict[tuple[str, str, int, int], PreparedTransfer] = {}
        # subscriber -> (the slot its last complete version went to, reached one-sidedly)
        self.landed: dict[str, tuple[int, bool]] = {}
        self.takes_delta: dict[str, bool] = {}  # subscriber -> it takes deltas (DELTA word, and the route)
        self._memory_link: dict[str, bool] = {}  # subscriber -> its last push went over a same-host link

    def takers(self, among: Iterable[str] | None = None) -> list[str]:
        """The subscribers (of ``among``, or all known) that take deltas, as last pushed to."""
        return [n for n in (self.takes_delta if among is None else among) if self.takes_delta.get(n, False)]

    def holder(self, results: Mapping[str, SyncResult], serve: Mapping[str, Peer]) -> tuple[Peer, int] | None:
        """A subscriber of ``serve`` the version of ``results`` reached one-sidedly (its
        application takes no part in a copy back), and the slot it landed in; None if none."""
        for name, r in results.items():
            if r.status == SyncStatus.DONE and name in serve and self.landed[name][1]:
                return serve[name], self.landed[name][0]
        return None

    def forget(self, serving: set[tuple[str, str]]) -> None:
        """Drops what is kept for subscribers no longer served (``serving``: (name,
        incarnation)s): their prepared pushes (and what they hold, e.g. mappings of a dead
        subscriber's slots) and what was measured of them."""
        for c in [c for c in self._batches if (c[0], c[1]) not in serving]:
            del self._batches[c]
        for d in [d for d in self._deltas if (d[0], d[1]) not in serving]:
            del self._deltas[d]
        names = {n for n, _ in serving}
        for name in [n for n in self.landed if n not in names]:
            del self.landed[name]
        for name in [n for n in self.takes_delta if n not in names]:
            del self.takes_delta[name]
            self._memory_link.pop(name, None)
            self._crossover.forget(name)

    async def push(self, peer: Peer, version: int, snap: torch.Tensor, t0: float, feed: DeltaFeed | None = None,
                   chosen: Mapping[str, float] | None = None, relay_log: Log | None = None,
                   look: Look | None = None) -> tuple[SyncResult, bool]:
        """Pushes ``version`` into ``peer``'s free slot and makes it the front there (not the
        doorbell: the caller rings it), within the deadline: as a delta where ``feed`` is one
        (a delta version), ``peer`` holds its base and ``chosen`` (its crossover for this
        version) admits the version's sampled change; else dense, from the live tensors and
        ``snap``. With ``relay_log``, ``peer`` relays the version to its host (:meth:`write`).
        ``look``: its control block as just read (:meth:`look`; read here when None).

        Returns:
            Its :class:`SyncResult` (``t0``: when the publish began), and whether the peer was
            found lost (that incarnation is gone for good).

        Cancellation: aborts its transfers; the subscriber keeps its front.
        """
        sub, moved = peer.name, [0, 0]  # bytes written, whether as a delta
        lost = False
        handles: list[Transfer] = []
        status = SyncStatus.STRAGGLER
        error: str | None = f"not complete within the {self.deadline:g}s deadline"
        with anyio.CancelScope() as scope:

            def clock() -> None:
                """(Re)starts the deadline: it runs from the end of the diff, our own work."""
                scope.deadline = anyio.current_time() + self.deadline

            clock()
            try:
                await self._push(peer, version, snap, handles, moved, feed, chosen or {}, clock, relay_log, look)
                status, error = SyncStatus.DONE, None
            except TransportError as exc:
                status, error = SyncStatus.FAILED, f"{type(exc).__name__}: {exc}"
                lost = isinstance(exc, PeerLostError)
            finally:
                for h in handles:
                    h.cancel()
        seconds = time.perf_counter() - t0
        if status != SyncStatus.DONE:
            log.warning("publisher %s: version %d to %s: %s (%s)", self.t.name, version, sub, status.value, error)
        return SyncResult(sub, version, status, moved[0], seconds, error, delta=bool(moved[1])), lost

    def prepared(self, peer: Peer, slot: int, snap: torch.Tensor, piece: int = -1) -> PreparedTransfer:
        """The prepared put of every bucket (from the live tensors, or the snapshot ``snap``)
        into ``peer``'s slot ``slot``, or of the buckets of piece ``piece`` (:attr:`pieces`)
        alone: made once per subscriber incarnation, slot, snapshot (and piece)."""
        cache_key = (peer.name, peer.incarnation, slot, snap.data_ptr(), piece)
        prepared = self._batches.get(cache_key)
        if prepared is None:  # (those of subscribers no longer served are dropped by forget)
            key = self._keys.slots[slot]
            buckets = self.layout.buckets if piece < 0 else self.layout.buckets[slice(*self.pieces[piece])]
            items = [(self._source(snap, start, end), key, start) for start, end in buckets]
            prepared = self._batches[cache_key] = self.t.prepare_put(peer.name, items)
        return prepared

    def delta_put(self, peer: Peer, slot: int, source: Source) -> PreparedTransfer:
        """The prepared put of every run a delta version's parts may take from ``source`` (its
        window) into ``peer``'s slot ``slot``, which each part starts with its own runs: made
        once per subscriber incarnation, slot and source."""
        cache_key = (peer.name, peer.incarnation, slot, source.buffer.data_ptr())
        prepared = self._deltas.get(cache_key)
        if prepared is None:  # (those of subscribers no longer served are dropped by forget)
            prepared = self._deltas[cache_key] = self.t.prepare_put_runs(peer.name, source.buffer,
                                                                         self._keys.slots[slot], source.window)
        return prepared

    def drop(self, peer: Peer, slot: int, snap: torch.Tensor) -> None:
        """Forgets the prepared put into ``peer``'s slot ``slot`` (its warm failed)."""
        self._batches.pop((peer.name, peer.incarnation, slot, snap.data_ptr(), -1), None)

    def warmed(self) -> set[tuple[str, str, int]]:
        """The (subscriber, incarnation, slot)s that have a prepared put: pushed to or warmed."""
        return {c[:3] for c in self._batches if c[4] < 0}

    def _holds_base(self, peer: Peer, ctl: torch.Tensor, nslots: int, back: int, base: int) -> bool:
        """Whether ``peer`` (its control block read into ``ctl``) takes deltas, has applied
        exactly version ``base`` and has nothing newer waiting in a slot. Its words are anyone's to
        write: a wrong claim costs nothing but a refused delta (its checksums catch it)."""
        index = peer.regions.get(self._keys.deltas[back])
        front = decode_front(int(ctl[FRONT]), nslots)
        return (nslots == 2 and int(ctl[DELTA]) == 1 and index is not None and index.nbytes == self._index_bytes
                and int(ctl[APPLIED]) == base and front is not None and front[0] == base)

    async def look(self, peer: Peer) -> Look:
        """Reads ``peer``'s control block and finds the slot a version may be written into
        (waits while every slot is taken: bound it with the caller's cancel scope).

        Raises:
            LayoutMismatchError: its slots or its layout are not this publisher's.
            TransportError: its block cannot be read (it left, or did not answer).
        """
        t, k, sub = self.t, self._keys, peer.name
        slot_bytes = peer.regions[k.slots[0]].nbytes
        if slot_bytes != self.layout.total:
            raise LayoutMismatchError(f"{sub}'s slots hold {slot_bytes} bytes; this layout needs {self.layout.total}")
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        await t.get(ctl, sub, key=k.ctl)
        if int(ctl[LAYOUT_ID]) != self.layout.layout_id:
            raise LayoutMismatchError(
                f"{sub} subscribed to a different layout of {self.stream!r} (restart it or let it re-subscribe)"
            )
        nslots = 3 if k.slots[2] in peer.regions else 2
        self.takes_delta[sub] = int(ctl[DELTA]) == 1 and (self._delta_everywhere
                                                           or not self._memory_link.get(sub, False))
        back = free_slot(ctl, nslots)
        if back is None:  # it is applying or living in them: look again (within the caller's deadline)

            async def freed() -> int | Pending:
                await t.get(ctl, sub, key=k.ctl)
                slot = free_slot(ctl, nslots)
                return PENDING if slot is None else slot

            back = await poll(freed, timeout=None, what=f"{t.name}: no slot of {sub} free")
        return Look(ctl, nslots, back)

    async def applied(self, peer: Peer, version: int) -> None:
        """Returns once ``peer`` has applied ``version`` or a later one (its ``APPLIED`` word),
        looking again after ``APPLIED_FIRST_S``, then twice that, at most ``APPLIED_LONGEST_S``;
        bound it with the caller's cancel scope.

        Raises:
            TransportError: its block cannot be read (it left, or did not answer).
        """
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)

        async def done() -> bool | Pending:
            await self.t.get(ctl, peer.name, key=self._keys.ctl)
            return True if int(ctl[APPLIED]) >= version else PENDING

        await poll(done, timeout=None, what=f"{self.t.name}: {peer.name} applying version {version}",
                   first=APPLIED_FIRST_S, longest=APPLIED_LONGEST_S)

    def wants_delta(self, peer: Peer, look: Look, feed: DeltaFeed | None, chosen: Mapping[str, float]) -> bool:
        """Whether a version of ``feed`` (None: a dense version) goes to ``peer`` as a delta: it
        takes deltas over its path, holds the base, and its crossover admits the sampled change."""
        return feed is not None and self.takes_delta[peer.name] and 0 < chosen.get(peer.name, 0.0) >= feed.fraction \
            and self._holds_base(peer, look.ctl, look.nslots, look.back, feed.base)

    async def _push(self, peer: Peer, version: int, snap: torch.Tensor, handles: list[Transfer], moved: list[int],
                    feed: DeltaFeed | None, chosen: Mapping[str, float], clock: Callable[[], None],
                    relay_log: Log | None = None, look: Look | None = None) -> None:
        look = look or await self.look(peer)
        await self.write(peer, look, snap, handles, moved, feed if self.wants_delta(peer, look, feed, chosen) else None,
                         clock, relay_log)
        await self.commit(peer, look.back, version)

    async def write(self, peer: Peer, look: Look, snap: torch.Tensor, handles: list[Transfer], moved: list[int],
                    feed: DeltaFeed | None, clock: Callable[[], None], relay_log: Log | None = None) -> None:
        """Writes a version into ``peer``'s slot ``look.back``: the parts of ``feed`` (a delta
        it holds the base of) as the diff hands them out, else dense. With ``relay_log`` (``peer``
        relays the version to its host), each part is logged once it is in ``peer``'s memory,
        and how the version ended. ``moved``: set to [bytes written, whether as a delta]."""
        t, k, sub, back = self.t, self._keys, peer.name, look.back
        ctl = look.ctl
        if relay_log is not None:
            await relay_log.begin()
        if feed is not None:
            # Only what changed since the base it holds: each part of the encodings as the diff
            # hands it out (the rest is diffed meanwhile), then the header beside the slot. A
            # part's runs from each of its sources start that source's prepared put.
            index = 0
            while (part := await feed.part(index)) is not None:
                for source, runs in part:
                    handles.append(self.delta_put(peer, back, source).start(runs=runs, timeout=self.deadline))
                    if relay_log is not None:
                        relay_log.follow(handles[-1], [(o, n) for _, o, n in runs.tolist()])
                index += 1
            clock()
            dv = await feed.done()
            if dv.is_delta:
                handles.append(t.put_many(sub, [(dv.header, k.deltas[back], 0)], timeout=self.deadline))
                nbytes, moved[1] = dv.wire_bytes, 1
            else:  # every tensor went dense after all: the version goes as usual, after the parts
                for h in handles:
                    await h
                handles.clear()
        if not moved[1]:
            # Dense, also in a delta version (its packed buckets were packed before the pushes):
            # at once, without waiting for the diff.
            if int(ctl[DELTA]) == 1 and k.deltas[back] in peer.regions:
                # That slot's delta header may name this version (a restarted publisher counts
                # again): cleared first, so the dense bytes are never read as a delta.
                await t.put(torch.zeros(1, dtype=torch.int64), sub, key=k.deltas[back], offset=0,
                            timeout=self.deadline)
            pushed = time.perf_counter()  # (a small push completes inside start())
            if relay_log is None:
                # The whole version as one prepared transfer into that slot: its segment list
                # (coalesced, checked, and packed into each backend's native list) is built the
                # first time and reused every later version with this subscriber, slot and snapshot.
                handles.append(self.prepared(peer, back, snap).start(timeout=self.deadline))
            else:  # piece by piece, each logged once it landed: its host's members follow
                await self._pieces_into(peer, back, snap, handles, relay_log)
            nbytes = self.layout.total
        for h in handles:
            await h
        if relay_log is not None:
            await relay_log.end(bool(moved[1]), nbytes)
        moved[0] = nbytes
        if not moved[1]:
            self._crossover.pushed_dense(sub, time.perf_counter() - pushed)
        self._memory_link[sub] = all(h.same_host is True for h in handles)
        self.takes_delta[sub] = self.takes_delta[sub] and (self._delta_everywhere or not self._memory_link[sub])
        # Reached one-sidedly (every backend that carried it): its slot can be read back for the
        # snapshot fill without its application taking part.
        self.landed[sub] = (back, all(h.one_sided is True for h in handles))

    async def _pieces_into(self, peer: Peer, slot: int, snap: torch.Tensor, handles: list[Transfer],
                           relay_log: Log) -> None:
        """Moves the pieces of a dense version into a relay's slot on the one piece schedule
        (:func:`transport._pieces.run`): started in order, at most ``RELAY_WINDOW`` in flight
        (all at once, every piece would land near the end: nothing for the members to follow,
        and nothing to tell a stalled relay from a busy link), each logged as it lands, none
        started after one failed.

        Raises:
            TransportError: the first a piece raised.
        """

        async def move(i: int) -> None:
            first, last = self.pieces[i]
            handles.append(self.prepared(peer, slot, snap, i).start(timeout=self.deadline))
            relay_log.follow(handles[-1], [(a, b - a) for a, b in self.layout.buckets[first:last]])
            await handles[-1]

        await _pieces.run(range(len(self.pieces)), move, RELAY_WINDOW)

    async def commit(self, peer: Peer, slot: int, version: int) -> None:
        """Makes ``peer``'s slot ``slot`` (every byte of ``version`` is in it) its front."""
        front = torch.tensor([encode_front(version, slot)], dtype=torch.int64)
        await self.t.put(front, peer.name, key=self._keys.ctl, offset=FRONT * 8)

    def relayed(self, peer: Peer, slot: int) -> None:
        """``peer`` got a version into ``slot`` from its host's relay (its own copies)."""
        self.landed[peer.name] = (slot, False)
