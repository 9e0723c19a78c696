"""The snapshot side of a stream publish, phase by phase (:class:`VersionPipeline`): settle the
last version's background work, choose the crossover and sample (or pack) the version, announce
it in the control block, diff it into a :class:`DeltaFeed` beside the pushes, complete the
snapshot ``pull`` reads, and after the publish begin the background pass a next delta needs.

It is the one owner of the publisher's snapshots: every write into them (packing, the fill from
a subscriber's slot, a delta's copies and patches, the background copy into the other snapshot)
is started here and nowhere else; the pushes only read them. Its state lives from one publish
to the next: the delta encoder and its checksums, the crossover model, and the background pass.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch

from .._background import start_background
from .._errors import TransportInternalError
from ._codec.checksum import PAUSE_S, SumPass, deltable
from ._codec.encode import DeltaEncoder, DeltaVersion
from ._codec.parts import PARTS
from ._codec.policy import CROSSOVER, Crossover
from ._control import DIFFING, FILLING, FRONT, LATEST, StreamKeys, decode_front, memory_barrier
from ._copy import available_threads, cores
from ._delta_feed import DeltaFeed
from ._layout import Layout
from ._report import DeltaStats
from ._snapshots import Snapshots

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from .. import Peer, Transport

log = logging.getLogger(__name__)


@dataclass
class Version:
    """One version on its way through the pipeline (made by :meth:`VersionPipeline.begin`).

    Attributes:
        number: the version.
        slot: the snapshot it is written into.
        front: (version, slot) of the snapshot in front when it began (None: none yet).
        snap: that snapshot's buffer.
        learning: the background checksum pass :meth:`VersionPipeline.settle` paused for it
            ((slot, version, pass) of the dense snapshot it covers), if any.
        feed: its delta encodings as the diff hands them out (None: it goes dense to all).
        chosen: its crossover per subscriber that takes deltas (0.0: dense to it).
        announced_at: when :meth:`VersionPipeline.announce` began (``time.perf_counter()``).
        diffed_at: when its diff ended (its announcement's end, undiffed).
        sample: the sample of its change (predicts dense, changed, sampled), if taken.
        dv: its delta version once diffed; sums: its tensors' checksums then.
        ended: its snapshot's write was ended (or handed to a background task that ends it).
    """

    number: int
    slot: int
    front: tuple[int, int] | None
    snap: torch.Tensor
    learning: tuple[int, int, SumPass] | None
    feed: DeltaFeed | None = None
    chosen: Mapping[str, float] = field(default_factory=dict)
    diffed_at: float = 0.0
    announced_at: float = 0.0
    sample: tuple[bool, int, int] | None = None
    dv: DeltaVersion | None = None
    sums: list[int] = field(default_factory=list)
    ended: bool = False

    @property
    def diff_s(self) -> float:
        """Seconds its diff took after the announcement (0.0 undiffed)."""
        return self.diffed_at - self.announced_at


class VersionPipeline:
    """The snapshots of one stream publisher and everything that writes them.

    Args:
        transport: the publisher's Transport.
        keys: the stream's region names.
        layout: its packed layout.
        wire: the live tensors by wire name.
        deadline: bounds a background fill.
        delta: whether versions may be diffed (host state only: see ``Publisher``).
        crossover: the fixed crossover, or None to choose it per version and subscriber.
    """

    def __init__(self, transport: Transport, keys: StreamKeys, layout: Layout, wire: Mapping[str, torch.Tensor],
                 deadline: float, delta: bool, crossover: float | None) -> None:
        self.t, self.layout = transport, layout
        self.snapshots = Snapshots(transport, keys, layout, wire, deadline)
        on_host = all(not v.is_cuda for v in wire.values())
        self.delta = DeltaEncoder(layout, wire, available_threads(), crossover or CROSSOVER,
                                  self.snapshots.packed) if delta and on_host else None
        entries = [e for e in layout.entries if deltable(e)]
        n = sum(e.numel for e in entries)
        es = round(sum(e.nbytes for e in entries) / n) if n else 2
        self.crossover = Crossover(crossover, layout.total, n, es, available_threads())
        # The diff hands its encodings to the pushes in parts while it runs where it leaves cores
        # free for them (else in one part, once done: see PARTS).
        self.parts = PARTS if cores() > available_threads() else 1
        self._takers = False  # whether a subscriber served by the last publish takes deltas
        self._change: float | None = None  # the changed fraction of the last version sampled or diffed
        # The checksum pass over the last dense snapshot, begun in the background: (slot, version, pass)
        self._learning: tuple[int, int, SumPass] | None = None
        self._ahead: threading.Thread | None = None  # the thread that runs it (and readies what follows)
        self._paused: tuple[int, int, SumPass] | None = None  # the pass settle() paused, for begin()

    @property
    def staging_bytes(self) -> int:
        """Two packed snapshots, plus the buffer of delta encodings when delta sync is on."""
        return 2 * self.layout.total + (self.delta.staging_bytes if self.delta is not None else 0)

    def worth_readying(self, takers: Collection[str]) -> bool:
        """Whether a later version may be diffed for one of ``takers`` (subscribers that take
        deltas): :meth:`Crossover.worth_readying` at the change last seen."""
        return self.delta is not None and any(self.crossover.worth_readying(n, self._change) for n in takers)

    async def settle(self) -> None:
        """Phase 0: ends the last version's background writes into the snapshot the next one
        writes (a fill is abandoned, a completion awaited, the background pass paused).

        Raises:
            TransportInternalError: the background pass did not stop within ``PAUSE_S`` (a
                later publish waits for it again).
        """
        await self.snapshots.abandon_fill()
        learning, self._learning = self._learning, None
        if learning is not None:
            # Its copy into the snapshot this publish writes stops first (one piece in flight).
            try:
                await anyio.to_thread.run_sync(learning[2].pause, PAUSE_S)
            except TransportInternalError:
                self._learning = learning  # still writing there: the next publish waits again
                raise
        self._paused = learning
        self.snapshots.end_copy()

    def begin(self, number: int) -> Version:
        """Phase 1: starts writing the snapshot that is not the front (after :meth:`settle`)."""
        front = decode_front(int(self.snapshots.ctl[FRONT]))
        slot = self.snapshots.begin()
        paused, self._paused = self._paused, None
        return Version(number, slot, front, self.snapshots.snaps[slot], paused)

    async def prepare(self, v: Version, takers: Collection[str]) -> None:
        """Phase 2 (beside the roster's scan): chooses ``v``'s crossover for each of ``takers``
        and samples its change (a version that changed too much goes dense at once, exactly as
        with ``delta=False``), readies the base's checksums for a diff, and packs what cannot go
        straight from the live tensors. No diff at all while no subscriber takes deltas or none's
        path makes one pay."""
        delta, front = self.delta, v.front
        if delta is not None and front is not None and self._takers:
            crossover = await self._choose(v, takers)
            if crossover > 0:
                delta.crossover = crossover
                v.sample = await anyio.to_thread.run_sync(self._sample_and_pack, v, delta, front[1])
            if v.sample is not None and not v.sample[0]:
                if delta.base_of(front[1], front[0]) is None:  # filled by a dense publish
                    await anyio.to_thread.run_sync(delta.learn, front[1], front[0], self.snapshots.snaps[front[1]],
                                                   self._started_pass(v), v.slot)
                v.feed = DeltaFeed(front[0], v.sample[1] / v.sample[2] if v.sample[2] else 0.0)
        if v.feed is None and delta is not None:
            delta.forget(v.slot)
        # Only what cannot go straight from the live tensors is packed before the pushes (a delta
        # version too: a subscriber that gets it dense is pushed at once, beside the diff); the
        # rest of the snapshot (for pull) is filled after them: copying it meanwhile would
        # compete with the pushes for memory bandwidth and cores.
        # (Sampled, it was packed on the sample's thread. A base whose checksums are learned
        # above has its deltable tensors copied into this snapshot by that pass, after the pack:
        # the delta patches or copies all of those that are not dense, so only the pack's other
        # bytes must last, and the pass copies none of those.)
        if v.sample is None:
            await anyio.to_thread.run_sync(self.snapshots.pack, v.slot)

    def _sample_and_pack(self, v: Version, delta: DeltaEncoder, base: int) -> tuple[bool, int, int]:
        """Samples ``v``'s change against snapshot ``base`` and packs ``v``, on one worker
        thread (each hand-off to one costs a wake-up, up to milliseconds on a busy host)."""
        sample = delta.predicts_dense(self.snapshots.snaps[base])
        self.snapshots.pack(v.slot)
        return sample

    def announce(self, v: Version, takers: Collection[str]) -> None:
        """Phase 3 (before any subscriber's front names ``v``: they check): the latest version,
        whether subscribers should ready a delta's base (``DIFFING``), and, for a delta
        version, that its snapshot is being completed (``pull`` waits for it)."""
        v.announced_at = time.perf_counter()
        ctl = self.snapshots.ctl
        ctl[LATEST] = v.number
        if v.sample is not None and v.sample[2]:
            self._change = v.sample[1] / v.sample[2]
        ctl[DIFFING] = int(self.worth_readying(takers))
        if v.feed is not None:
            ctl[FILLING] = v.number
        memory_barrier()
        v.diffed_at = time.perf_counter()

    async def diff(self, v: Version) -> None:
        """Phase 4 (beside the pushes; nothing for a dense version): diffs ``v`` against the
        front snapshot, writing only the encodings (and what a delta push sends from the new
        snapshot) and handing them to its feed part by part, so pushes to subscribers that
        hold the base send each part while the rest is diffed."""
        feed, delta, front = v.feed, self.delta, v.front
        if feed is None or delta is None or front is None:
            return
        try:
            made, v.sums = await anyio.to_thread.run_sync(
                functools.partial(delta.encode, v.snap, v.slot, self.snapshots.snaps[front[1]], front[0], front[1],
                                  v.number, feed.ready(), self.parts))
        except BaseException:
            feed.fail()
            raise
        feed.close(made)
        self.crossover.diffed(made.encode_s, made.density)
        v.dv, self._change = made, made.density
        v.diffed_at = time.perf_counter()

    async def complete(self, v: Version, holder: tuple[Peer, int] | None, rings: TaskGroup | None,
                       rings_pending: Callable[[], bool], applied: Callable[[], Awaitable[None]]) -> None:
        """Phase 5 (after the pushes): brings the rest of ``v``'s snapshot to the version, here
        for what needs the live tensors (they are free once the publish returns), and in a
        task of ``rings`` (once the doorbells rang) for the rest: a delta's patches, which read
        only the encodings, or the buckets that went straight from the live tensors, from
        ``holder`` (a subscriber reached one-sidedly, and its slot holding ``v``). Without
        ``rings`` (closing) it all runs here.

        The patches wait, besides, for ``applied()`` (the subscribers on this host applied
        ``v``; bounded, and cut short by the next publish): beside two subscribers' applies on
        the 2-core VM they made a delta version go live 5-15 ms later over tcp (they scatter
        into the whole snapshot, memory-bound, as the applies do into the live tensors). A
        fill is not held so: it is abandoned by the next publish, and held it would be
        abandoned far more often by a trainer that publishes back to back."""
        snapshots, delta, dv = self.snapshots, self.delta, v.dv
        if dv is not None and delta is not None:
            # Most deltas patch every tensor: then no worker thread is woken for nothing (beside
            # the subscribers' applies on a busy host, waking one took up to 10 ms).
            if delta.copies_left(dv):
                await anyio.to_thread.run_sync(delta.fill_copies, v.snap, dv)
            if rings is None:
                await anyio.to_thread.run_sync(delta.fill_patches, v.snap, dv)
                self._finish(v)
                delta.commit(v.slot, v.number, v.sums)
            else:
                snapshots.complete_in_background(rings, v.slot, v.number, functools.partial(delta.fill_patches,
                                                                                            v.snap, dv),
                                                 rings_pending, applied,
                                                 functools.partial(delta.commit, v.slot, v.number, v.sums))
                v.ended = True  # (the background task ends it)
        elif holder is not None and snapshots.direct and rings is not None:
            # No one writes the holder's slot before our next publish.
            snapshots.fill_in_background(rings, holder[0], holder[1], v.slot, v.number, rings_pending)
            v.ended = True  # (the background task ends it)
        else:
            await anyio.to_thread.run_sync(snapshots.fill_direct, v.slot)
            self._finish(v)

    def _finish(self, v: Version) -> None:
        """Ends ``v``'s write here, complete: its snapshot is the front for pullers."""
        self.snapshots.finish(v.slot, v.number, True)
        v.ended = True

    def end(self, v: Version) -> None:
        """Ends ``v``'s write if :meth:`complete` did not (the publish failed or was cancelled):
        unpublished, and pullers read the front as before."""
        if not v.ended:
            self.snapshots.finish(v.slot, v.number, False)
            v.ended = True

    def after(self, v: Version, takers: Collection[str], rings: TaskGroup | None) -> None:
        """Phase 6, once ``v`` is published (``takers``: the subscribers it served that take
        deltas): remembers whether there were any, and after a dense version a delta may
        follow (one of ``takers`` is worth readying) begins the checksum pass over its snapshot
        in the background (the next publish finishes it), which copies it into the other
        snapshot on the way: the next version then only patches it, so the first delta after a
        dense version costs what the others do (before, 1.3-1.6x of them:
        delta_sync-2026-12-04-ipc.md)."""
        self._takers = bool(takers)
        if v.learning is not None:
            v.learning[2].stop()  # used by prepare, or not needed: it takes no more pieces
        if v.dv is None and rings is not None and self.worth_readying(takers):
            self._learning = (v.slot, v.number, SumPass.of_buffer(v.snap, self.layout.entries,
                                                                  copy_to=self.snapshots.snaps[1 - v.slot]))
            rings.start_soon(self._learn_when_filled, *self._learning)

    def forget(self, serving: set[tuple[str, str]]) -> None:
        """Drops the prepared fills from subscribers (name, incarnation) no longer served."""
        self.snapshots.forget(serving)

    def stats(self, v: Version) -> DeltaStats | None:
        """What the delta machinery did with ``v`` (None: delta sync is off)."""
        delta, dv, sample = self.delta, v.dv, v.sample
        if delta is None:
            return None
        if dv is not None:
            return DeltaStats(base=dv.base, changed=dv.changed, elements=dv.elements, dense_bytes=self.layout.total,
                              delta_bytes=dv.wire_bytes if dv.is_delta else self.layout.total, encode_s=dv.encode_s,
                              kinds={k.name.lower(): dv.kinds.count(k) for k in set(dv.kinds)},
                              crossover=delta.crossover)
        # Dense without a full diff: no base, the model or the sample said so.
        return DeltaStats(base=None, changed=sample[1] if sample else 0, elements=sample[2] if sample else 0,
                          dense_bytes=self.layout.total, delta_bytes=self.layout.total, encode_s=0.0,
                          kinds={"dense": len(self.layout.entries)}, sampled=sample is not None,
                          crossover=delta.crossover if sample is not None else 0.0 if v.chosen else None)

    def stop(self) -> None:
        """Stops the background pass (it takes no more pieces); :meth:`aclose` waits for it."""
        if self._learning is not None:
            self._learning[2].stop()

    async def aclose(self) -> None:
        """Stops the background pass and waits (at most ``PAUSE_S``) for its thread: its piece
        in flight ends in milliseconds, and a thread left in native code when the interpreter
        exits would abort the process. Cancellation: shielded."""
        self.stop()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(ahead.join, PAUSE_S)
            if ahead.is_alive():
                log.warning("publisher %s: its background checksum pass did not end within %gs", self.t.name,
                            PAUSE_S)

    def _started_pass(self, v: Version) -> SumPass | None:
        """The background pass over the snapshot in front of ``v``, if one was begun over it."""
        learning, front = v.learning, v.front
        return learning[2] if learning is not None and front is not None and learning[:2] == front[::-1] else None

    async def _choose(self, v: Version, takers: Collection[str]) -> float:
        """Chooses ``v``'s crossover for each of ``takers`` (into ``v.chosen``) from what was
        measured on its path, counting what a first delta after the dense version in front
        still pays (the part of the background pass not done); returns the highest, the one
        the version is diffed by (0.0: no delta pays, the version goes dense undiffed).
        Calibrates this host first, once (about 0.15 s on the 2-core VM; usually done already,
        in the background after the first version)."""
        assert self.delta is not None and v.front is not None
        if self.crossover.fixed is None and not self.crossover.calibrated:
            await anyio.to_thread.run_sync(self.crossover.calibrate)
        first_s = self.crossover.first_s(*self.delta.unready_bytes(v.front[1], v.front[0], self._started_pass(v)))
        v.chosen = self.crossover.value(list(takers), first_s)
        return max(v.chosen.values(), default=0.0)

    async def _learn_when_filled(self, slot: int, version: int, sums: SumPass) -> None:
        """Begins the checksum pass ``sums`` over dense snapshot ``slot`` (which copies it into
        the other snapshot) on a background thread once the snapshot holds all of ``version``
        (its fill may still run), unless the next publish has begun (it pauses the pass); the
        same thread then readies the staging buffer of the encodings for the first delta."""
        await self.snapshots.settled()
        delta = self.delta
        if delta is not None and self._learning is not None and self._learning[2] is sums and \
                decode_front(int(self.snapshots.ctl[FRONT])) == (version, slot):
            # No publish has begun since (it takes the pass first): the other snapshot is ours
            # to write until the next one pauses the pass.
            delta.forget(self.snapshots.begin_copy())

            def ahead() -> None:
                sums.drain()
                if not sums.stopped and self.crossover.fixed is None:  # (stopped: closing)
                    self.crossover.calibrate()
                if not sums.stopped:
                    delta.reserve()

            self._ahead = start_background(ahead, sums.stop)
