"""Boxes: axis-aligned blocks of a global tensor, and the byte segments that copy one.

A box is a tuple of half-open ``(lo, hi)`` intervals, one per dimension, in the coordinates of
a global tensor (for a 0-d tensor, the empty tuple: one element). Everything here is pure
arithmetic on ints and numpy arrays, so every rank computes the same result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Box = tuple[tuple[int, int], ...]  # one half-open (lo, hi) interval per dimension
Shape = tuple[int, ...]  # a tensor's (or a box's) extent per dimension


def full_box(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> Shape:
    """The extent of ``box`` per dimension."""
    return tuple(hi - lo for lo, hi in box)


def volume(box: Box) -> int:
    """Elements in ``box`` (1 for a 0-d box)."""
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one tensor, or None when it is empty."""
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=True):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def contains(outer: Box, inner: Box) -> bool:
    """Whether ``inner`` lies inside ``outer``."""
    return all(olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner, strict=True))


def shift(box: Box, by: Sequence[int]) -> Box:
    """``box`` moved by ``by`` (one offset per dimension)."""
    return tuple((lo + d, hi + d) for (lo, hi), d in zip(box, by, strict=True))


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """Interval ``index`` of ``[0, n)`` cut into ``parts`` as ``torch.chunk`` and DTensor's
    ``Shard`` cut it: pieces of ``ceil(n / parts)``, the last ones shorter or empty."""
    size = -(-n // parts) if parts else 0
    lo = min(index * size, n)
    return lo, min(lo + size, n)


def split_even(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` contiguous intervals whose lengths differ by at most one
    (the first ones longer); no empty interval when ``parts <= hi - lo``."""
    n = hi - lo
    base, extra = divmod(n, parts)
    out, at = [], lo
    for i in range(parts):
        step = base + (1 if i < extra else 0)
        out.append((at, at + step))
        at += step
    return out


def row_major(shape: Sequence[int], origin: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """The addressing of a contiguous row-major tensor of ``shape`` that holds the global box
    starting at ``origin``: ``(base, strides)`` with element offset ``base + sum(x * strides)``
    for global coordinates ``x``."""
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= int(shape[d])
    return -sum(o * st for o, st in zip(origin, strides, strict=True)), tuple(strides)


def segments(box: Box, src: tuple[int, Sequence[int]], dst: tuple[int, Sequence[int]]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contiguous runs that copy ``box`` (global coordinates) from one tensor to another.

    ``src`` and ``dst`` are addressings ``(base, strides)`` (see :func:`row_major`): element
    ``x`` of the box is at ``base + sum(x * strides)`` in each. Inner dimensions that continue
    each other in both are merged into one run, and touching runs are joined.

    Returns:
        ``(src_offsets, dst_offsets, lengths)``, int64 arrays in elements, in row-major order of
        the box (empty when the box is).
    """
    (sb, ss), (db, ds) = src, dst
    ext = box_shape(box)
    s0 = sb + sum(lo * st for (lo, _), st in zip(box, ss, strict=True))
    d0 = db + sum(lo * st for (lo, _), st in zip(box, ds, strict=True))
    if volume(box) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    nd = len(ext)
    run, inner = 1, nd
    if nd and ss[-1] == 1 and ds[-1] == 1:
        run, inner = ext[-1], nd - 1
        while inner > 0 and ss[inner - 1] == run and ds[inner - 1] == run:
            inner -= 1
            run *= ext[inner]
    s_off, d_off = np.array([s0], np.int64), np.array([d0], np.int64)
    for d in range(inner):  # one run per index of the outer dimensions
        steps = np.arange(ext[d], dtype=np.int64)
        s_off = (s_off[:, None] + steps[None, :] * ss[d]).reshape(-1)
        d_off = (d_off[:, None] + steps[None, :] * ds[d]).reshape(-1)
    return coalesce(s_off, d_off, np.full(s_off.shape, run, np.int64))


def coalesce(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Joins consecutive runs that continue each other in both the source and the destination
    (order kept); drops empty runs."""
    keep = lengths > 0
    src, dst, lengths = src[keep], dst[keep], lengths[keep]
    if len(lengths) < 2:
        return src, dst, lengths
    cont = (src[1:] == src[:-1] + lengths[:-1]) & (dst[1:] == dst[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    sums = np.add.reduceat(lengths, starts)
    return src[starts], dst[starts], sums
