"""The ordering rule between transfers of one Transport to one region: a transfer that overlaps
the bytes of an earlier one still in flight (where either writes) starts moving only once that
one has ended, so the later put wins; transfers that do not overlap run concurrently."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import anyio

from ._transfer import Transfer
from ._wire import TransferOp

_SCAN_MAX = 64  # transfers in flight that clear_of() compares one by one


class Ranges:
    """The transfers in flight to one region, in start order, for the ordering rule.

    Adding is O(1) in the common case of transfers that do not overlap the span of those in
    flight (e.g. a state dict pushed bucket by bucket); otherwise it scans them.
    """

    __slots__ = ("_hi", "_lo", "_xfers")

    def __init__(self) -> None:
        self._xfers: list[tuple[Transfer, int, int]] = []
        self._lo = self._hi = 0  # a span covering every range in flight (may be wider)

    def add(self, xfer: Transfer, start: int, end: int) -> list[Transfer]:
        """Adds ``xfer``, which covers bytes ``start``..``end`` here; returns the earlier
        transfers it must wait for (they overlap it, and one of the two writes)."""
        after = [] if self._outside(start, end) else list(self._blocking(xfer.op, start, end))
        self._lo, self._hi = (start, end) if not self._xfers else (min(self._lo, start), max(self._hi, end))
        self._xfers.append((xfer, start, end))
        return after

    def clear_of(self, op: TransferOp, start: int, end: int) -> bool:
        """Whether a transfer over bytes ``start``..``end`` would wait for none in flight here
        (cheaply: past a few dozen in flight inside its span, it answers False)."""
        if self._outside(start, end):
            return True
        return len(self._xfers) <= _SCAN_MAX and next(self._blocking(op, start, end), None) is None

    def _outside(self, start: int, end: int) -> bool:
        """Whether bytes ``start``..``end`` cannot overlap anything in flight (O(1))."""
        return not self._xfers or end <= self._lo or start >= self._hi or start == end

    def _blocking(self, op: TransferOp, start: int, end: int) -> Iterator[Transfer]:
        """The transfers in flight that one of ``op`` over ``start``..``end`` must wait for."""
        writes = op == TransferOp.PUT
        return (x for x, lo, hi in self._xfers if (writes or x.op == TransferOp.PUT) and lo < end and start < hi)

    def remove(self, xfer: Transfer) -> bool:
        """Removes ``xfer``; True when nothing is left in flight."""
        for i, entry in enumerate(self._xfers):
            if entry[0] is xfer:
                del self._xfers[i]
                break
        return not self._xfers


def spans_of(ranges: Iterable[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """Per region key, the byte span ``(lo, hi)`` that the ``(key, offset, nbytes)`` ranges
    cover (what a transfer of all of them counts as, for the ordering rule)."""
    out: dict[str, tuple[int, int]] = {}
    for key, offset, nbytes in ranges:
        lo, hi = out.get(key, (offset, offset + nbytes))
        out[key] = (min(lo, offset), max(hi, offset + nbytes))
    return out


async def ended_within(transfers: Sequence[Transfer], timeout: float) -> list[Transfer]:
    """Waits up to ``timeout`` for ``transfers`` to end (observing only); returns those still
    running then."""
    with anyio.move_on_after(timeout):
        for x in transfers:
            await x._ended()
    return [x for x in transfers if not x.done()]
