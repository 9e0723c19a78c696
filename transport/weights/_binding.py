"""The binding phase of mesh sync: the planner's moves bound to bytes of the stream's regions.

The planner (:mod:`transport.plan`) works in elements of global boxes and local tensors and
knows no addresses. Binding places them: a trainer rank packs its box of every tensor it holds
into its snapshots (:func:`snapshot_layout`), a generator rank lays its local tensors out in
its slots (:func:`slot_layout`), and :func:`byte_runs` turns the moves between the two into
``(snapshot offset, slot offset, nbytes)`` rows, which prepared transfers take as they are.
Every rank binds from the published layouts alone, so a trainer rank and a generator rank agree
on every offset without exchanging any. The control words that say when those bytes may be
written or read are :mod:`._mesh_control`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ..plan import (
    ITEMSIZE,
    GeneratorRank,
    LocalTensor,
    Move,
    Planner,
    Shape,
    TrainerLayout,
    box_shape,
    full_box,
    volume,
)

ALIGN = 64  # every packed tensor starts on a 64-byte boundary

Offsets = dict[str, tuple[int, int]]  # tensor name -> (byte offset, nbytes)


def snapshot_layout(layout: TrainerLayout, rank: int) -> tuple[list[tuple[str, Shape, str]], Offsets, int]:
    """What trainer ``rank`` packs into a snapshot, and where.

    Args:
        layout: the trainer layout (the same on every rank).
        rank: the trainer rank.

    Returns:
        ``(name, shape of its box, dtype)`` of every tensor the rank holds a non-empty box of, at
        the layout's dtype, in packing order; name -> (offset, nbytes) in the snapshot; and the
        snapshot's size. The publisher packs by it; a generator rank pulling from that trainer
        rank reads by it.
    """
    packed = []
    for spec in layout.tensors:
        box = spec.sharding.boxes(spec.shape).get(rank)
        if box is not None and volume(box) > 0:
            packed.append((spec.name, box_shape(box), spec.dtype))
    offsets, total = pack((n, volume(full_box(shape)) * ITEMSIZE[d]) for n, shape, d in packed)
    return packed, offsets, total


def slot_layout(rank: GeneratorRank) -> tuple[Offsets, int]:
    """Where each local tensor of a generator rank lies in its slots (name -> (offset,
    nbytes)), and the size of a slot."""
    return pack((lt.name, lt.nbytes) for lt in rank.tensors)


def byte_runs(planner: Planner, moves: Iterable[Move], local: Mapping[str, LocalTensor],
              snapshot: Mapping[str, tuple[int, int]], slot: Mapping[str, tuple[int, int]]) -> np.ndarray:
    """Every byte run of ``moves`` into one generator rank.

    Args:
        planner: the planner of the trainer layout the moves come from.
        moves: moves out of one trainer rank's snapshot into the generator rank.
        local: the generator rank's local tensors by name.
        snapshot: the trainer rank's snapshot offsets (:func:`snapshot_layout`).
        slot: the generator rank's slot offsets (:func:`slot_layout`).

    Returns:
        ``(snapshot offset, slot offset, nbytes)`` per run, as an int64 ``(N, 3)`` array: what
        ``prepare_put_runs`` takes as it is (pushes go snapshot -> slot; pulls, slot <-
        snapshot, swap the first two columns). The planner's run arrays stay arrays: no Python
        object per run.
    """
    parts = []
    for m in moves:
        lt = local[m.dst_tensor]
        item = ITEMSIZE[lt.dtype]
        src, dst, n = planner.segments(m, lt)
        parts.append(np.stack([snapshot[m.name][0] + src.astype(np.int64) * item,
                               slot[m.dst_tensor][0] + dst.astype(np.int64) * item, n.astype(np.int64) * item],
                              axis=1))
    return np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.int64)


def pack(items: Iterable[tuple[str, int]]) -> tuple[Offsets, int]:
    """Byte offsets of ``(name, nbytes)`` items packed in order, each aligned to ``ALIGN``.

    Returns:
        name -> (offset, nbytes), and the total size (at least 1: a region is never empty).
    """
    out, at = {}, 0
    for name, nbytes in items:
        at = -(-at // ALIGN) * ALIGN
        out[name] = (at, nbytes)
        at += nbytes
    return out, max(at, 1)


def cut_runs(runs: np.ndarray, piece_bytes: int) -> list[np.ndarray]:
    """``runs`` (``(snapshot offset, slot offset, nbytes)`` rows) cut into consecutive pieces of
    ``piece_bytes`` each (the last may be smaller), a run that crosses a piece's end split
    there: the pieces a push into a relay is logged by, which its members cut the same way
    from the same runs. Deterministic: the same runs and size give the same pieces.

    Raises:
        ValueError: ``piece_bytes`` < 1.
    """
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be >= 1, not {piece_bytes}")
    runs = np.ascontiguousarray(runs, dtype=np.int64).reshape(-1, 3)
    if not len(runs):
        return []
    ends = np.cumsum(runs[:, 2])
    starts = ends - runs[:, 2]
    total = int(ends[-1])
    out = []
    for lo in range(0, total, piece_bytes):
        hi = min(lo + piece_bytes, total)
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(starts, hi, side="left"))
        part = runs[first:last].copy()
        cut_lo = lo - starts[first:last]
        cut_hi = ends[first:last] - hi
        head = np.maximum(cut_lo, 0)
        part[:, 0] += head
        part[:, 1] += head
        part[:, 2] -= head + np.maximum(cut_hi, 0)
        out.append(part[part[:, 2] > 0])
    return out
