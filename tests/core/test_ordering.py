"""The ordering rule's bookkeeping (transport/_ordering.py): which transfers a new one waits for,
and the cheap question put() asks before it moves bytes synchronously."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from transport._ordering import _SCAN_MAX, Ranges
from transport._transfer import Transfer
from transport._wire import TransferOp

OPS = st.sampled_from([TransferOp.PUT, TransferOp.GET])
SPAN = st.tuples(st.integers(0, 64), st.integers(0, 16)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=500, deadline=None)
@given(earlier=st.lists(st.tuples(OPS, SPAN), max_size=12), op=OPS, span=SPAN, gone=st.sets(st.integers(0, 11)))
def test_clear_of_never_says_clear_when_add_would_wait(earlier, op, span, gone):
    """Whatever is in flight (some of it ended since): when clear_of says a transfer waits for
    nothing, add() agrees; and when add() would wait for nothing, clear_of says so (below the
    scan limit)."""
    ranges = Ranges()
    xfers = []
    for o, (lo, hi) in earlier:
        x = Transfer(o, "p", "k", hi - lo, lo)
        ranges.add(x, lo, hi)
        xfers.append(x)
    for i in sorted(gone):
        if i < len(xfers):
            ranges.remove(xfers[i])
    clear = ranges.clear_of(op, *span)
    waits = ranges.add(Transfer(op, "p", "k", span[1] - span[0], span[0]), *span)
    assert clear == (not waits)


def test_past_the_scan_limit_an_overlapping_span_is_not_clear():
    ranges = Ranges()
    for i in range(_SCAN_MAX + 1):
        ranges.add(Transfer(TransferOp.PUT, "p", "k", 4, 8 * i), 8 * i, 8 * i + 4)
    assert not ranges.clear_of(TransferOp.PUT, 4, 8)  # inside the span: too many to compare
    assert ranges.clear_of(TransferOp.PUT, 8 * (_SCAN_MAX + 1), 8 * (_SCAN_MAX + 2))  # past it: clear at once
    assert ranges.clear_of(TransferOp.GET, 4, 4)  # empty
