"""The per-tensor checksum of delta sync (:func:`transport._native.delta.checksum`: a
position-mixed sum, mod 2**64, of a tensor's raw bits; defined in ``csrc/delta.h``), which
tensors have one, and the passes that compute it over many tensors: :class:`SumPass`, whose
pieces a background thread and the caller's copy threads share."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from ..._errors import TransportInternalError
from ..._native import delta as native
from ..._tensors import dtype_from_name
from .._copy import PIECE_BYTES, HostCopies
from .._layout import Entry
from .format import MASK64

PAUSE_S = 10.0  # bounds the wait for a background pass's piece in flight (one piece: milliseconds)


def deltable(e: Entry) -> bool:
    """Whether ``e`` can travel as a delta: a 2- or 4-byte element type sent as it is (fp8
    entries are quantised per version, other sizes always go dense)."""
    return e.scale_offset < 0 and e.numel > 0 and dtype_from_name(e.wire_dtype).itemsize in (2, 4)


def bytes_checksum(t: torch.Tensor) -> int | None:
    """The checksum of a contiguous tensor's bytes taken as 2-byte units, on the calling thread;
    None for an odd byte size."""
    nbytes = t.numel() * t.element_size()
    return None if nbytes % 2 else native.checksum(t.data_ptr(), nbytes // 2, 2)


def checksums_of(buf: torch.Tensor, entries: Sequence[Entry], threads: int) -> list[int]:
    """The checksum of each entry's bytes in ``buf`` (a host slot or snapshot), split across
    ``threads`` in pieces (0 for entries that are not deltable)."""
    sums = SumPass.of_buffer(buf, entries).finish(threads)
    return [0 if x is None else x for x in sums]


class SumPass:
    """One checksum pass over tensors, in pieces any thread may take: started in the background
    (:meth:`drain` on a thread of its own) and finished, when its sums are needed, by the
    caller's copy threads (:meth:`finish`), which take the pieces nobody took and compute again
    the few still in flight on a background thread rather than wait for it (a piece's checksum
    is the same whoever computes it). It holds the tensors it reads.

    A pass that also copies (``copy_to``) writes each piece's bytes there as it sums them, so
    one read of the source does both; it never computes a piece twice: :meth:`finish` first
    pauses the background (:meth:`pause`: waits for its piece in flight), so no store of it lands
    after the caller goes on to write the destination.

    Args:
        tensors: per entry, the tensor whose bytes are summed (None: no sum).
        entries: the layout entries (their element sizes and counts).
        offsets: per entry, the byte offset in its tensor where its elements start.
        copy_to: a buffer laid out like ``tensors`` (the same offsets) that each piece's bytes
            are copied into, or None.
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None], entries: Sequence[Entry],
                 offsets: Sequence[int], copy_to: Sequence[torch.Tensor | None] | None = None) -> None:
        self._tensors = list(tensors)
        self._copy_to = None if copy_to is None else list(copy_to)
        # (entry, address, elements, size, first, destination address or 0)
        self._pieces: list[tuple[int, int, int, int, int, int]] = []
        for i, (e, t, offset) in enumerate(zip(entries, tensors, offsets, strict=True)):
            if t is None or not deltable(e):
                continue
            dst = self._copy_to[i] if self._copy_to is not None else None
            es = dtype_from_name(e.wire_dtype).itemsize
            per = max(1, PIECE_BYTES // es)
            for first in range(0, e.numel, per):
                at = offset + first * es
                self._pieces.append((i, t.data_ptr() + at, min(per, e.numel - first), es, first,
                                     0 if dst is None else dst.data_ptr() + at))
        self._parts: list[int | None] = [None] * len(self._pieces)
        self._next = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the background's piece ends
        self._busy = 0  # pieces in flight on background threads
        self._stopped = False
        self._paused = False  # background threads take no more pieces (finish() still does)

    @classmethod
    def of_buffer(cls, buf: torch.Tensor, entries: Sequence[Entry], copy_to: torch.Tensor | None = None) -> SumPass:
        """The pass over each entry's bytes in the packed buffer ``buf`` (copied into the
        packed buffer ``copy_to`` on the way, when given)."""
        n = len(entries)
        return cls([buf] * n, entries, [e.offset for e in entries], None if copy_to is None else [copy_to] * n)

    @property
    def copies(self) -> bool:
        """Whether the pass copies what it sums."""
        return self._copy_to is not None

    @property
    def left(self) -> float:
        """The share of its pieces no thread has taken yet (0.0 when done, 1.0 before it began)."""
        with self._lock:
            return (len(self._pieces) - self._next) / len(self._pieces) if self._pieces else 0.0

    def _take(self, background: bool) -> int | None:
        with self._lock:
            if self._stopped or (background and self._paused) or self._next >= len(self._pieces):
                return None
            self._next += 1
            self._busy += background
            return self._next - 1

    def _compute(self, j: int) -> None:
        _, ptr, n, es, first, dst = self._pieces[j]
        self._parts[j] = native.checksum(ptr, n, es, first, dst)

    def _drain(self, background: bool) -> None:
        while (j := self._take(background)) is not None:
            try:
                self._compute(j)
            finally:
                if background:
                    with self._idle:
                        self._busy -= 1
                        self._idle.notify_all()

    def drain(self) -> None:
        """Computes pieces until none is left to take, or the pass is stopped or paused (on a
        background thread)."""
        self._drain(True)

    def stop(self) -> None:
        """No piece is taken any more (one in flight ends on its own; its sum is never used)."""
        with self._lock:
            self._stopped = True

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped

    def pause(self, timeout: float) -> None:
        """Background threads take no more pieces (for good); returns once the piece in flight
        on one, if any, has ended (one piece: milliseconds).

        Raises:
            TransportInternalError: a background piece still runs after ``timeout`` seconds (its
                stores may yet land: the destination must not be written).
        """
        with self._idle:
            self._paused = True
            if not self._idle.wait_for(lambda: self._busy == 0, timeout):
                raise TransportInternalError(f"a background checksum pass did not stop within {timeout:g}s")

    def finish(self, threads: int) -> list[int | None]:
        """Computes what is left on up to ``threads`` threads (this one included; on this one
        alone once the pass is stopped) and returns the sum per entry (None where there is
        none). A copying pass is paused first (see :meth:`pause`) and has copied every piece
        when this returns.

        Raises:
            TransportInternalError: a copying pass's background piece did not end (see
                :meth:`pause`).
        """
        if self._copy_to is not None:
            self.pause(PAUSE_S)
        batch = HostCopies()
        left = len(self._pieces) - self._next
        for _ in range(max(1, min(threads, left))):
            batch.add(max(1, left // max(1, threads)) * PIECE_BYTES, functools.partial(self._drain, False))
        batch.run(threads)
        for j, part in enumerate(self._parts):
            if part is None:  # still in flight on a background thread (or the pass stopped): computed here
                self._compute(j)
        sums: list[int | None] = [None] * len(self._tensors)
        for (i, *_), part in zip(self._pieces, self._parts, strict=True):
            assert part is not None
            sums[i] = ((sums[i] or 0) + part) & MASK64
        return sums
