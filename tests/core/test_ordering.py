"""The ordering rule's bookkeeping (transport/_transfers/ordering.py): which transfers a new one waits for,
the cheap question put() asks before it moves bytes synchronously, and an index that holds
exactly what is in flight."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from transport._transfers.handle import Transfer
from transport._transfers.ordering import Ranges
from transport._wire import TransferOp

OPS = st.sampled_from([TransferOp.PUT, TransferOp.GET])
SPAN = st.tuples(st.integers(0, 64), st.integers(0, 16)).map(lambda t: (t[0], t[0] + t[1]))


def overlaps_by_brute_force(inflight, op, lo, hi):
    if lo == hi:  # an empty transfer moves nothing: it waits for nothing
        return []
    return [x for x, (xlo, xhi) in inflight if (op == TransferOp.PUT or x.op == TransferOp.PUT)
            and xlo < hi and lo < xhi]


@settings(max_examples=500, deadline=None)
@given(earlier=st.lists(st.tuples(OPS, SPAN), max_size=12), op=OPS, span=SPAN, gone=st.sets(st.integers(0, 11)))
def test_add_waits_for_exactly_the_overlapping_writers_and_clear_of_agrees(earlier, op, span, gone):
    """Whatever is in flight (some of it ended since): add() returns exactly the transfers in
    flight that overlap the new one where either writes (compared with a brute-force scan), and
    clear_of says a transfer waits for nothing exactly when add() would wait for nothing."""
    ranges = Ranges()
    inflight = []
    for o, (lo, hi) in earlier:
        x = Transfer(o, "p", "k", hi - lo, lo)
        ranges.add(x, lo, hi)
        inflight.append((x, (lo, hi)))
    for i in sorted(gone, reverse=True):
        if i < len(inflight):
            x, (lo, _hi) = inflight.pop(i)
            ranges.remove(x, lo)
    assert len(ranges) == len(inflight)
    clear = ranges.clear_of(op, *span)
    waits = ranges.add(Transfer(op, "p", "k", span[1] - span[0], span[0]), *span)
    assert sorted(map(id, waits)) == sorted(map(id, overlaps_by_brute_force(inflight, op, *span)))
    assert clear == (not waits)


def test_thousands_in_flight_are_answered_exactly_and_leave_nothing_behind():
    """A state dict pushed bucket by bucket: 10,000 puts in flight at increasing offsets, ended
    in random order. Every question is answered exactly (no conservative 'not clear' past some
    count), and once all ended the index is empty."""
    ranges, n, size = Ranges(), 10_000, 4096
    xfers = [Transfer(TransferOp.PUT, "p", "k", size, i * 2 * size) for i in range(n)]
    for x in xfers:
        assert ranges.add(x, x.offset, x.offset + size) == []
    assert len(ranges) == n
    assert ranges.clear_of(TransferOp.PUT, size, 2 * size)  # the gap between two buckets
    assert not ranges.clear_of(TransferOp.GET, 10 * size + 1, 10 * size + 2)  # inside bucket 5
    assert ranges.add(Transfer(TransferOp.GET, "p", "k", 2, 10 * size + 1), 10 * size + 1, 10 * size + 3) == [xfers[5]]
    random.Random(7).shuffle(xfers)
    for i, x in enumerate(xfers):
        ranges.remove(x, x.offset)
        assert len(ranges) == n - i  # the GET added above is still in flight
    assert not ranges.remove(Transfer(TransferOp.PUT, "p", "k", 1, 0), 0)  # not there: nothing removed
    assert len(ranges) == 1


def test_a_wide_range_in_flight_is_found_from_far_inside_it():
    ranges = Ranges()
    wide = Transfer(TransferOp.PUT, "p", "k", 1 << 30, 0)
    ranges.add(wide, 0, 1 << 30)
    for i in range(100):
        ranges.add(Transfer(TransferOp.GET, "p", "k", 8, (1 << 30) + 8 * i), (1 << 30) + 8 * i, (1 << 30) + 8 * i + 8)
    assert ranges.add(Transfer(TransferOp.GET, "p", "k", 8, 1 << 29), 1 << 29, (1 << 29) + 8) == [wide]
    assert ranges.clear_of(TransferOp.GET, 1 << 31, (1 << 31) + 8)
