"""The ordering rule between transfers of one Transport to one region: a transfer that overlaps
the bytes of an earlier one still in flight (where either writes) starts moving only once that
one has ended, so the later put wins; transfers that do not overlap run concurrently."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

import anyio

from .._wire import TransferOp
from .handle import Transfer


class Ranges:
    """The transfers in flight to one region, for the ordering rule, indexed by where they start.

    Adding and removing a transfer costs O(log n) (a binary search, and a list insertion or
    deletion that moves pointers); finding the ones a new transfer overlaps looks only at those
    starting less than the longest range in flight before its end, so a state dict pushed
    bucket by bucket (ranges of similar sizes, in order) costs O(log n) per transfer whatever is
    in flight. The index holds exactly the transfers in flight: each is removed when it ends.
    """

    __slots__ = ("_hi", "_keys", "_longest", "_seq", "_xfers")

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []  # (start, seq) of every transfer in flight, sorted
        self._xfers: dict[int, tuple[Transfer, int, int]] = {}  # seq -> (transfer, start, end)
        self._seq = itertools.count()
        self._longest = 0  # the longest range added since the index was last empty
        self._hi = 0  # an end at or past every range in flight (may be wider)

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, xfer: Transfer, start: int, end: int) -> list[Transfer]:
        """Adds ``xfer``, which covers bytes ``start``..``end`` here; returns the earlier
        transfers it must wait for (they overlap it, and one of the two writes)."""
        after = [] if self._outside(start, end) else list(self._blocking(xfer.op, start, end))
        if not self._keys:
            self._longest = self._hi = 0
        seq = next(self._seq)
        bisect.insort(self._keys, (start, seq))
        self._xfers[seq] = (xfer, start, end)
        self._longest = max(self._longest, end - start)
        self._hi = max(self._hi, end)
        return after

    def clear_of(self, op: TransferOp, start: int, end: int) -> bool:
        """Whether a transfer of ``op`` over bytes ``start``..``end`` would wait for none in
        flight here."""
        return self._outside(start, end) or next(self._blocking(op, start, end), None) is None

    def _outside(self, start: int, end: int) -> bool:
        """Whether bytes ``start``..``end`` cannot overlap anything in flight (O(1))."""
        return not self._keys or start == end or end <= self._keys[0][0] or start >= self._hi

    def _blocking(self, op: TransferOp, start: int, end: int) -> Iterator[Transfer]:
        """The transfers in flight that one of ``op`` over ``start``..``end`` must wait for: those
        overlapping it where either writes. Only ranges starting in ``(start - longest, end)``
        can overlap it."""
        writes = op == TransferOp.PUT
        lo = bisect.bisect_right(self._keys, (start - self._longest, -1))
        hi = bisect.bisect_left(self._keys, (end, -1))
        for _start, seq in self._keys[lo:hi]:
            x, s, e = self._xfers[seq]
            if (writes or x.op == TransferOp.PUT) and s < end and start < e:
                yield x

    def remove(self, xfer: Transfer, start: int) -> bool:
        """Removes ``xfer``, added at ``start``; True when nothing is left in flight."""
        i = bisect.bisect_left(self._keys, (start, -1))
        while i < len(self._keys) and self._keys[i][0] == start:
            seq = self._keys[i][1]
            if self._xfers[seq][0] is xfer:
                del self._keys[i]
                del self._xfers[seq]
                break
            i += 1
        return not self._keys


async def ended_within(transfers: Sequence[Transfer], timeout: float) -> list[Transfer]:
    """Waits up to ``timeout`` for ``transfers`` to end (observing only); returns those still
    running then."""
    with anyio.move_on_after(timeout):
        for x in transfers:
            await x._ended()
    return [x for x in transfers if not x.done()]
