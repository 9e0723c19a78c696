"""The target side of the ``tcp`` backend: serving a peer's PUT / GET (one range) and PUTR /
GETR (a table of runs) frames, which ``TcpBackend.serve_frame`` hands here once the request
parsed. Every range is checked against the live registration before a payload byte is taken, and
what a frame holds grows only with the bytes that moved: a stalled peer costs what it sent.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ..._agent import Conn
from ..._errors import BackendUnavailableError, BoundsError, TransportError, TransportInternalError, WireError
from ..._native import INLINE_MAX_BYTES, Copier, CopyKind, CopyStatus
from ..._regions import Region, RegionTable
from ..._wire import FrameKind, TransferOp
from ._frames import MAX_STAGED_BYTES, RUN_ROW, RangeRequest, RunsRequest, TcpFrame

# The target side makes a frame's views of its runs this many at a time (one recvmsg_into /
# sendmsg call's worth), as the bytes move: a frame of many runs whose peer stalls holds a batch
# of views, never one per run.
_VIEW_BATCH = 1024
# A staged GETR's reply is gathered this many bytes at a time, each part only once the one
# before it is in the socket: a peer that does not read its reply holds one part (about what its
# socket's kernel buffer holds), never the frame's MAX_STAGED_BYTES. Each part is gathered by
# copies of at most _REPLY_COPY bytes, made right here (Copier.copy_packed).
_REPLY_PART = 256 << 10
_REPLY_COPY = INLINE_MAX_BYTES


async def serve_runs(regions: RegionTable, conn: Conn, kind: int, rid: int, request: RunsRequest,
                     payload_len: int, copier: Copier) -> None:
    """The target side of a PUTR / GETR: reads the run table (its size was bounded from the
    frame's header, and its buffer grows only with the bytes that arrive), checks every run
    (non-negative, aligned to its region's items, inside it) and each group's region once for
    its runs' span, before any data byte is taken; a refusal drains the rest of the payload,
    so nothing is written and the stream stays in step. Then the data goes straight into the
    regions (or back from them), run by run, the runs' views made a batch at a time as the
    bytes move; a staged PUTR's data (at most MAX_STAGED_BYTES) is received whole first (its
    buffer growing with what arrives) and placed by one native copy job, and a staged GETR's
    reply is gathered and sent ``_REPLY_PART`` bytes at a time."""
    op = TransferOp.PUT if kind == TcpFrame.PUTR else TransferOp.GET
    table = await conn.recv_bytes(request.table_bytes)
    rows = np.frombuffer(table, dtype="<i8").reshape(request.count, RUN_ROW // 8)
    offsets, sizes = rows[:, 0], rows[:, 1]
    data = payload_len - request.table_bytes
    placed: list[tuple[Region, np.ndarray]] = []  # each group's region and its rows
    try:
        if (rows < 0).any() or (offsets > (1 << 62) - sizes).any():
            raise BoundsError(f"{regions.owner}: a run with a negative or huge offset or size")
        first = 0
        for key, dtype, count in request.groups:
            mine = rows[first : first + count]
            first += count
            lo, hi = int(mine[:, 0].min()), int((mine[:, 0] + mine[:, 1]).max())
            region = regions.check(op, key, dtype, lo, hi - lo)
            item = region.tensor.element_size()
            if item > 1 and (mine % item != 0).any():
                raise BoundsError(f"{regions.owner}:{key!r}: a run is not aligned to {item}-byte items")
            if region.view is None:
                raise BackendUnavailableError(f"{regions.owner}:{key!r} is device memory; the agent's byte "
                                              "stream cannot reach it")
            placed.append((region, mine))
        if op == TransferOp.PUT and int(sizes.sum()) != data:
            raise WireError(f"{request.count} runs of {int(sizes.sum())} bytes with {data} data bytes")
        if request.staged and int(sizes.sum()) > MAX_STAGED_BYTES:
            raise WireError(f"a staged frame of {int(sizes.sum())} bytes (at most {MAX_STAGED_BYTES})")
    except TransportError as exc:
        await conn.refuse(rid, exc, discard=data)
        return
    if request.staged:
        there = np.concatenate([mine[:, 0] + region.tensor.data_ptr() for region, mine in placed])
        if op == TransferOp.PUT:  # (placed holds the regions' tensors until these return)
            await _place_staged(conn, rid, there, sizes, data, copier)
        else:
            await _send_staged(conn, rid, there, sizes, copier)
        return
    if op == TransferOp.PUT:
        for views in _run_views(placed):
            await conn.recv_into(views)
        await conn.reply(FrameKind.OK, rid, {})
    else:
        await conn.reply_head(FrameKind.DATA, rid, {}, int(sizes.sum()))
        for views in _run_views(placed):
            await conn.send(views)


def _run_views(placed: Sequence[tuple[Region, np.ndarray]]) -> Iterator[list[memoryview]]:
    """Views of the checked runs ``placed`` (each group's region and its rows), in table order,
    ``_VIEW_BATCH`` at a time: made as they are asked for, never all at once."""
    batch: list[memoryview] = []
    for region, mine in placed:
        view = region.view
        assert view is not None  # (host memory: checked)
        for first in range(0, len(mine), _VIEW_BATCH):
            for o, n in mine[first : first + _VIEW_BATCH].tolist():
                batch.append(view[o : o + n])
                if len(batch) == _VIEW_BATCH:
                    yield batch
                    batch = []
    if batch:
        yield batch


async def _place_staged(conn: Conn, rid: int, there: np.ndarray, sizes: np.ndarray, data: int,
                        copier: Copier) -> None:
    """A checked staged PUTR: its runs' bytes, packed back to back, are received (into a buffer
    that grows with what arrives) and placed at the addresses ``there`` by one native copy job
    (the caller keeps the regions' tensors referenced until it returns)."""
    at = np.cumsum(sizes) - sizes
    buf = await conn.recv_bytes(data)
    stage = np.frombuffer(buf, dtype=np.uint8)
    job = np.stack([there, at + stage.ctypes.data, sizes], axis=1).astype(np.uint64).tobytes()
    result = await copier.copy_packed(CopyKind.LOCAL, 0, job, data)
    if result.status != CopyStatus.OK:
        await conn.refuse(rid, TransportInternalError(f"placing {len(sizes)} staged runs failed (errno {result.err})"))
        return
    await conn.reply(FrameKind.OK, rid, {})


async def _send_staged(conn: Conn, rid: int, there: np.ndarray, sizes: np.ndarray, copier: Copier) -> None:
    """A checked staged GETR: the runs at the addresses ``there``, packed back to back, are
    gathered into one buffer of ``_REPLY_PART`` bytes, a part at a time, each part sent before
    the next is gathered (the caller keeps the regions' tensors referenced until it returns).
    The gather is laid out once: the runs cut at every multiple of ``_REPLY_COPY`` bytes of
    the reply, so that each piece is one copy made right here (Copier.copy_packed).

    Raises:
        TransportInternalError: a gather failed after the reply began (the connection closes).
    """
    total = int(sizes.sum())
    ends = np.cumsum(sizes)
    starts = ends - sizes
    cuts = np.union1d(starts, np.arange(0, total, _REPLY_COPY))
    lo, hi = cuts, np.append(cuts[1:], total)
    run = np.searchsorted(ends, lo, side="right")  # (every byte of the reply is in one run)
    part = np.empty(min(total, _REPLY_PART), dtype=np.uint8)
    rows = np.stack([lo % _REPLY_PART + part.ctypes.data, there[run] + (lo - starts[run]), hi - lo], axis=1)
    rows = rows[hi > lo].astype(np.uint64)
    piece = np.searchsorted(lo[hi > lo], np.arange(0, total, _REPLY_COPY))  # each copy's first row
    await conn.reply_head(FrameKind.DATA, rid, {}, total)
    for at in range(0, total, _REPLY_PART):
        n = min(_REPLY_PART, total - at)
        for k in range(at // _REPLY_COPY, (at + n + _REPLY_COPY - 1) // _REPLY_COPY):
            first, last = piece[k], piece[k + 1] if k + 1 < len(piece) else len(rows)
            size = min(_REPLY_COPY, total - k * _REPLY_COPY)
            result = await copier.copy_packed(CopyKind.LOCAL, 0, rows[first:last].tobytes(), size)
            if result.status != CopyStatus.OK:
                raise TransportInternalError(f"gathering {last - first} staged runs failed (errno {result.err})")
        await conn.send([memoryview(part)[:n]])  # type: ignore[arg-type]  # ndarray is a Buffer


async def serve_range(regions: RegionTable, conn: Conn, kind: int, rid: int, request: RangeRequest,
                      payload_len: int) -> None:
    """The target side of a tcp PUT / GET of one range: it is checked against the live
    registration before any byte is taken (a refusal reads and drops the payload, so nothing
    is written and the stream stays in step); then the payload is received straight into the
    region (or the range is sent back)."""
    op = TransferOp.PUT if kind == TcpFrame.PUT else TransferOp.GET
    key, offset, nbytes = request.key, request.offset, request.nbytes
    try:
        region = regions.check(op, key, request.dtype, offset, nbytes)
        if region.view is None:
            raise BackendUnavailableError(f"{regions.owner}:{key!r} is device memory; the agent's byte "
                                          "stream cannot reach it")
    except TransportError as exc:
        await conn.refuse(rid, exc, discard=payload_len)
        return
    view = region.view[offset : offset + nbytes]
    if op == TransferOp.PUT:
        await conn.recv_into([view])
        await conn.reply(FrameKind.OK, rid, {})
    else:
        await conn.reply(FrameKind.DATA, rid, {}, [view])
