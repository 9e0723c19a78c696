"""The publisher's two packed snapshots of a stream: what ``pull`` reads (``Snapshots``).

A publish packs what cannot travel straight from the live tensors (several small tensors in a
bucket, fp8) into the snapshot that is not the front, while the snapshot's generation counter
is odd (a seqlock: pullers skip it). The buckets that went straight from the live tensors are
filled in afterwards, in the background, from a subscriber's slot that holds the version (the
live tensors are free again by then), and only then is the snapshot made the front. A fill
still running when the next publish starts is abandoned for that publish's own, at most
``MAX_ABANDONED_FILLS`` times in a row.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import anyio
import torch

from .. import _tensor_kernels
from .._errors import TransportError
from ._control import CTL_WORDS, FILLING, FRONT, GEN0, LAYOUT_ID, StreamKeys, decode_front, encode_front, memory_barrier
from ._copy import HostCopies, available_threads
from ._layout import Entry, Layout

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from .. import Peer, PreparedTransfer, Transport

log = logging.getLogger(__name__)

# The background snapshot fill starts once the doorbells of its version were acknowledged, or
# after this long (a subscriber busy generating acknowledges when it next yields).
FILL_AFTER_RINGS_S = 0.05
# A delta's patches wait, besides, until the subscribers on this host that took the version have
# applied it, at most this long in all: beside their applies the patches take the cores and the
# memory bandwidth those need (see VersionPipeline.complete). The next publish cuts the wait
# short: it needs the patches done before its own diff.
PATCH_AFTER_APPLIES_S = 1.0
FILL_STOP_S = 10.0  # bounds the wait for an abandoned fill's copy to stop
MAX_ABANDONED_FILLS = 3  # in a row; then a publish waits for the fill (pull() is at most 3 versions behind)

Bucket = tuple[int, int]  # [start, end) byte range of a version


async def _after_rings(rings_pending: Callable[[], bool]) -> None:
    """Returns once ``rings_pending()`` is False (the version's doorbells were acknowledged),
    at most after ``FILL_AFTER_RINGS_S``."""
    with anyio.move_on_after(FILL_AFTER_RINGS_S):
        while rings_pending():
            await anyio.sleep(0.001)


class Snapshots:
    """The two snapshots of one publisher, its control block (per-snapshot generation counters,
    the front, the version being filled) and the background fill.

    Args:
        transport: the publisher's Transport.
        keys: the stream's region names.
        layout: the packed layout.
        wire: the live tensors by wire name (read when packing and filling).
        deadline: bounds a background fill.
    """

    def __init__(self, transport: Transport, keys: StreamKeys, layout: Layout, wire: Mapping[str, torch.Tensor],
                 deadline: float) -> None:
        self.t = transport
        self._keys = keys
        self.layout = layout
        self._wire = wire
        self.deadline = deadline
        self._threads = available_threads()
        self.snaps: list[torch.Tensor] = []
        self.ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)  # the published block once registered
        self._filled: anyio.Event | None = None  # set when the last background fill ended
        self._fill_scope: anyio.CancelScope | None = None  # the last background fill's
        self._waiting: anyio.CancelScope | None = None  # the last completion's wait before its work
        self._abandoned = 0  # background fills abandoned in a row
        self._copying: int | None = None  # the snapshot a background copy may be writing (see begin_copy)
        # (subscriber, incarnation, its slot, our snapshot) -> the prepared get of a fill
        self._pulls: dict[tuple[str, str, int, int], PreparedTransfer] = {}
        self._plan_sources()

    def register(self) -> None:
        """Registers the snapshots and the control block, read-only to peers."""
        t, k = self.t, self._keys
        self.snaps = [t.empty(key, self.layout.total, torch.uint8, writable=False) for key in k.snapshots]
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        ctl[LAYOUT_ID] = self.layout.layout_id
        self.ctl = t.empty(k.pubctl, CTL_WORDS, torch.int64, writable=False)
        self.ctl.copy_(ctl)

    @property
    def direct(self) -> Mapping[Bucket, tuple[torch.Tensor, int]]:
        """The buckets sent straight from the live tensors: bucket -> (the tensor's bytes, its offset)."""
        return self._direct

    def begin(self) -> int:
        """Starts writing the snapshot that is not the front; returns its slot."""
        front = decode_front(int(self.ctl[FRONT]))
        slot = 0 if front is None else 1 - front[1]
        self.ctl[GEN0 + slot] += 1  # odd: the snapshot is being written (pullers skip it)
        memory_barrier()
        return slot

    def begin_copy(self) -> int:
        """Marks the snapshot that is not the front as being written by a background copy (its
        generation odd: a pull still reading it from when it was the front retries, and reads
        the front); returns its slot. Ended by :meth:`end_copy` before the next publish
        writes it."""
        slot = self.begin()
        self._copying = slot
        return slot

    def end_copy(self) -> None:
        """The background copy into the snapshot :meth:`begin_copy` marked has stopped writing
        (the caller waited for it): its generation even again. Does nothing without one."""
        if self._copying is not None:
            self.finish(self._copying, 0, False)
            self._copying = None

    def pack(self, slot: int) -> None:
        """Packs the buckets that cannot go straight from the live tensors into snapshot
        ``slot``: plain host bytes as raw copies, the rest as :meth:`_pack_ranges` does. Runs
        in a worker thread."""
        batch = HostCopies()
        base = self.snaps[slot].data_ptr()
        for offset, data, start, nbytes in self._raw:
            batch.add_raw(base + offset, data.data_ptr() + start, nbytes)
        batch.run(self._threads)
        self._pack_ranges(slot, self._rest_ranges)

    def fill_in_background(self, tg: TaskGroup, peer: Peer, sub_slot: int, slot: int, version: int,
                           rings_pending: Callable[[], bool]) -> None:
        """Fills snapshot ``slot``'s direct buckets from ``peer``'s slot ``sub_slot`` (which holds
        ``version``) in a task of ``tg``, once ``rings_pending()`` is False (at most
        ``FILL_AFTER_RINGS_S``), then makes it the front."""
        self.ctl[FILLING] = version
        self._filled = anyio.Event()
        self._fill_scope = anyio.CancelScope()  # made here: the next publish may cancel it before it starts
        tg.start_soon(self._fill_from, peer, sub_slot, slot, version, self._filled, self._fill_scope, rings_pending)

    def complete_in_background(self, tg: TaskGroup, slot: int, version: int, work: Callable[[], None],
                               rings_pending: Callable[[], bool], applied: Callable[[], Awaitable[None]],
                               done: Callable[[], None]) -> None:
        """Runs ``work`` (in a worker thread; it completes snapshot ``slot`` without the live
        tensors) in a task of ``tg``, once ``rings_pending()`` is False (at most
        ``FILL_AFTER_RINGS_S``) and ``applied()`` returned (at most ``PATCH_AFTER_APPLIES_S``;
        the next publish cuts it short), then makes the snapshot the front and calls ``done``.
        Unlike a fill it is never abandoned: the next publish waits for it (see
        :meth:`abandon_fill`)."""
        self.ctl[FILLING] = version
        self._filled = anyio.Event()
        self._fill_scope = None  # not to be abandoned
        self._waiting = anyio.CancelScope()
        tg.start_soon(self._complete, slot, version, work, rings_pending, applied, done, self._filled, self._waiting)

    async def _complete(self, slot: int, version: int, work: Callable[[], None], rings_pending: Callable[[], bool],
                        applied: Callable[[], Awaitable[None]], done: Callable[[], None], filled: anyio.Event,
                        waiting: anyio.CancelScope) -> None:
        complete = False
        try:
            with waiting:
                await _after_rings(rings_pending)  # as in _fill_from
                with anyio.move_on_after(PATCH_AFTER_APPLIES_S):
                    await applied()
            await anyio.to_thread.run_sync(work)
            complete = True
        except TransportError as exc:
            log.error("publisher %s: the snapshot of version %d could not be completed (%s); pull() serves "
                      "the previous version", self.t.name, version, exc)
        finally:
            self.finish(slot, version, complete)
            if complete:
                done()
            filled.set()

    async def settled(self) -> None:
        """Returns once no background fill or completion of a snapshot runs."""
        if self._filled is not None:
            await self._filled.wait()

    def forget(self, serving: set[tuple[str, str]]) -> None:
        """Drops the prepared fills from subscribers (name, incarnation) no longer served."""
        for c in [c for c in self._pulls if (c[0], c[1]) not in serving]:
            del self._pulls[c]

    def _plan_sources(self) -> None:
        """Which buckets can be sent straight from the live tensors (a byte range inside one
        unconverted contiguous tensor) and which must be packed first (several small tensors, or
        fp8), and which entries each bucket holds."""
        self._direct: dict[Bucket, tuple[torch.Tensor, int]] = {}
        for start, end in self.layout.buckets:
            for e in self.layout.entries:
                src = self._wire[e.name]
                if e.offset <= start and end <= e.offset + e.nbytes and e.scale_offset < 0 and src.is_contiguous():
                    self._direct[(start, end)] = (_tensor_kernels.as_bytes(src), e.offset)
                    break
        self._packed_ranges = [b for b in self.layout.buckets if b not in self._direct]
        # Bucket -> the entries with bytes in it (an fp8 entry's bytes run to the end of its scale);
        # a packed bucket keeps only those its raw copies below leave to _pack_ranges.
        starts = [a for a, _ in self.layout.buckets]
        self._members: dict[Bucket, list[Entry]] = {b: [] for b in self.layout.buckets}
        for e in self.layout.entries:
            end = e.scale_offset + 4 if e.scale_offset >= 0 else e.offset + e.nbytes
            if end <= e.offset:
                continue  # no bytes
            for i in range(max(0, bisect.bisect_right(starts, e.offset) - 1), len(starts)):
                bucket = self.layout.buckets[i]
                if bucket[0] >= end:
                    break
                if bucket[1] > e.offset:
                    self._members[bucket].append(e)
        # The plain host bytes among them are packed as raw copies, planned here once: (offset in
        # the snapshot, the tensor's bytes, offset in them, length). One native copy each with
        # the GIL released, where a torch copy per tensor held it for most of the pack: for the
        # example model's 33 small tensors 0.4-0.8 ms alone instead of 0.7-1.4, and beside the
        # roster's scan (Python, on the event loop) 0.7-2.4 ms instead of 3.3-5.7.
        self._raw: list[tuple[int, torch.Tensor, int, int]] = []
        for bucket in self._packed_ranges:
            rest = []
            for e in self._members[bucket]:
                src = self._wire[e.name]
                if e.scale_offset >= 0 or src.is_cuda or not src.is_contiguous():
                    rest.append(e)
                    continue
                lo, hi = max(bucket[0], e.offset), min(bucket[1], e.offset + e.nbytes)
                self._raw.append((lo, _tensor_kernels.as_bytes(src), lo - e.offset, hi - lo))
            self._members[bucket] = rest  # what _pack_ranges still packs
        self._rest_ranges = [b for b in self._packed_ranges if self._members[b]]
        # The entries :meth:`pack` writes bytes of (wholly or in part).
        self.packed = frozenset(e.name for e in self.layout.entries
                                if any(a < e.offset + e.nbytes and e.offset < b for a, b in self._packed_ranges))

    def fill_direct(self, slot: int) -> None:
        """Copies the buckets that went straight from the live tensors into snapshot ``slot``
        (what ``pull`` reads): host sources as one copy split across the cores.

        Runs in a worker thread; CUDA sources as in :meth:`pack`.
        """
        snap = self.snaps[slot]
        batch = HostCopies()
        with torch.no_grad():
            for (start, end), (data, offset) in self._direct.items():
                if data.is_cuda:
                    snap[start:end].copy_(data[start - offset : end - offset])
                else:
                    batch.add_raw(snap.data_ptr() + start, data.data_ptr() + start - offset, end - start)
        batch.run(self._threads)

    def _pack_ranges(self, slot: int, ranges: list[Bucket]) -> None:
        """Packs the bytes of ``ranges`` of the version into snapshot ``slot`` with one
        ``_tensor_kernels.pack`` per bucket. fp8 tensors that touch them are quantised whole, once.

        Runs in a worker thread; CUDA sources are read on that thread's current stream (the
        default stream), and every copy into the host snapshot has completed when this returns.
        """
        snap = self.snaps[slot]
        quantized: set[str] = set()
        plain: tuple[str, torch.Tensor] | None = None  # the last plain tensor's bytes (spans buckets)
        with torch.no_grad():
            for a, b in ranges:
                tensors: list[torch.Tensor] = []
                offsets: list[int] = []
                for e in self._members[(a, b)]:
                    src = self._wire[e.name]
                    if e.scale_offset >= 0:
                        if e.name not in quantized:
                            quantized.add(e.name)
                            q, scale = _tensor_kernels.quantize_fp8(src)
                            tensors += [q, scale]
                            offsets += [e.offset, e.scale_offset]
                        continue
                    if plain is None or plain[0] != e.name:
                        plain = (e.name, _tensor_kernels.as_bytes(src.contiguous()))
                    lo, hi = max(a, e.offset), min(b, e.offset + e.nbytes)
                    tensors.append(plain[1][lo - e.offset : hi - e.offset])
                    offsets.append(lo)
                _tensor_kernels.pack(snap, tensors, offsets)

    def source(self, snap: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Where bucket ``[start, end)`` is sent from: the live tensor's bytes, or snapshot ``snap``."""
        direct = self._direct.get((start, end))
        if direct is None:
            return snap[start:end]
        data, offset = direct
        return data[start - offset : end - offset]

    def finish(self, slot: int, version: int, complete: bool) -> None:
        """Ends the write of snapshot ``slot``: its generation even again, and, when it holds
        all of ``version``, the front for pullers."""
        memory_barrier()
        self.ctl[GEN0 + slot] += 1  # even: stable
        if complete:
            self.ctl[FRONT] = encode_front(version, slot)
        self.ctl[FILLING] = 0

    async def _fill_from(self, peer: Peer, sub_slot: int, slot: int, version: int, filled: anyio.Event,
                         scope: anyio.CancelScope, rings_pending: Callable[[], bool]) -> None:
        """Copies the buckets that went straight from the live tensors from ``peer``'s slot
        ``sub_slot`` (which holds ``version``) into snapshot ``slot``, then publishes it. On
        failure (the subscriber died meanwhile, the deadline) the snapshot is not published:
        pullers keep getting the previous version. Cancelled by ``aclose`` and through ``scope``
        (see :meth:`abandon_fill`)."""
        complete = False
        try:
            with scope:
                # First the doorbells of this version: on a few cores the copy would otherwise hold
                # back the subscribers' flips (their Python needs a core to see the doorbell).
                await _after_rings(rings_pending)
                h = self._pulled(peer, sub_slot, slot).start(timeout=self.deadline)
                try:
                    with anyio.move_on_after(self.deadline):
                        await h
                        complete = True
                finally:
                    if not h.done():  # abandoned (or closing): its copy stops before the snapshot is reused
                        h.cancel()
                        with anyio.CancelScope(shield=True), anyio.move_on_after(FILL_STOP_S):
                            await h._ended()
                if not complete:
                    log.warning("publisher %s: the snapshot of version %d was not filled from %s within %gs; "
                                "pull() serves the previous version", self.t.name, version, peer.name, self.deadline)
        except TransportError as exc:
            log.warning("publisher %s: the snapshot of version %d could not be filled from %s (%s); pull() "
                        "serves the previous version", self.t.name, version, peer.name, exc)
        finally:
            if complete:
                self._abandoned = 0
            self.finish(slot, version, complete)
            filled.set()

    async def abandon_fill(self) -> None:
        """Ends the previous publish's background snapshot fill if it still runs: it writes the
        snapshot this publish picks, and the new version's own fill supersedes it. Its snapshot
        is then not published, so pull() serves the version before it until this publish's fill
        completes (a trainer that publishes faster than a fill takes trades pull() freshness for
        not waiting). It waits instead while no snapshot is complete yet, and after
        ``MAX_ABANDONED_FILLS`` abandoned in a row, so pull() is at most that many versions
        behind. Bounded: a cancelled copy stops at its next native unit."""
        if self._filled is not None and not self._filled.is_set():
            if self._waiting is not None:
                self._waiting.cancel()  # a completion waits no more for the applies: it starts now
            front = decode_front(int(self.ctl[FRONT]))
            if front is not None and self._abandoned < MAX_ABANDONED_FILLS and self._fill_scope is not None:
                # (a fill cancelled before it started ends at once: its scope is cancelled on entry)
                self._abandoned += 1
                log.debug("publisher %s: abandoning the background snapshot fill", self.t.name)
                self._fill_scope.cancel()
            else:
                self._abandoned = 0
            await self._filled.wait()

    def _pulled(self, peer: Peer, sub_slot: int, slot: int) -> PreparedTransfer:
        """The prepared get of the direct buckets from ``peer``'s slot ``sub_slot`` into
        snapshot ``slot`` (made once per subscriber incarnation and slot pair)."""
        cache_key = (peer.name, peer.incarnation, sub_slot, slot)
        prepared = self._pulls.get(cache_key)
        if prepared is None:
            snap, key = self.snaps[slot], self._keys.slots[sub_slot]
            items = [(snap[start:end], key, start) for start, end in self._direct]
            prepared = self._pulls[cache_key] = self.t.prepare_get(peer.name, items)
        return prepared
