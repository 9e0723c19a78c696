"""Frames on a socket: the reads and writes every agent connection (control, ``tcp`` data)
travels by, on raw non-blocking sockets driven by ``anyio.wait_readable/wait_writable`` (the
same code under trio and asyncio; ``recv_into`` in place, without copies; many buffers per
system call). What the bytes mean is :mod:`transport._wire`'s.

Every read is bounded: a stalled peer ends the call after ``stall`` seconds without a byte,
buffers whose size another process announced (metadata, run tables, staged payloads) grow only
with the bytes that arrived, and discarded payloads all go through one small buffer per
process. An :class:`Activity` passed along records when the connection last moved a byte (the
agent makes room by closing the connection that moved none for longest).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from ._errors import WireError
from ._wire import FRAME_HEADER, MAX_META, decode_header, decode_meta

_IO_CHUNK = 4 << 20  # bytes per send/recv call; bounds how long one call holds the loop
_SOCK_BUF = 4 << 20
_YIELD_EVERY = 16  # let other tasks run at least every this many ready syscalls
_IOV_MAX = 1024  # buffers per sendmsg / recvmsg_into call (Linux's IOV_MAX)


class Activity:
    """When a connection last moved a byte in either direction (``time.monotonic()``)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay, large buffers."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # a smaller buffer only costs speed
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)


async def connect(address: tuple[str, int]) -> socket.socket:
    """A tuned socket connected to ``address``. Raises OSError; closes the socket on any failure."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        tune_socket(sock)
        try:
            sock.connect(address)
        except BlockingIOError:
            await anyio.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err)) from None
    except BaseException:
        sock.close()
        raise
    return sock


def _next_batch(views: Sequence[memoryview], i: int, pos: int) -> list[memoryview]:
    """The buffers of one vectored call from ``views[i][pos:]`` on: at most ``_IOV_MAX`` of
    them and about ``_IO_CHUNK`` bytes (the first may be cut to that)."""
    first = views[i][pos : pos + _IO_CHUNK]
    out, room = [first], _IO_CHUNK - len(first)
    for v in views[i + 1 : i + _IOV_MAX]:
        if room <= 0:
            break
        out.append(v)
        room -= len(v)
    return out


def _advance(views: Sequence[memoryview], i: int, pos: int, got: int) -> tuple[int, int]:
    """Where ``views[i][pos:]`` stands after ``got`` more bytes (empty views are passed over)."""
    while i < len(views) and got >= len(views[i]) - pos:
        got -= len(views[i]) - pos
        i, pos = i + 1, 0
    return i, pos + got


async def _wait_ready(wait: Callable[[socket.socket], Awaitable[None]], sock: socket.socket,
                      stall: float | None) -> None:
    """Waits until ``sock`` can move bytes; with ``stall``, at most that long (then
    TimeoutError, an OSError: the connection counts as ended)."""
    if stall is None:
        await wait(sock)
        return
    with anyio.move_on_after(stall) as scope:
        await wait(sock)
    if scope.cancelled_caught:
        raise TimeoutError(f"no progress for {stall:g}s")


async def _progressed(activity: Activity | None, ready: int) -> int:
    """After a system call that moved bytes: notes it in ``activity`` and lets other tasks run
    every ``_YIELD_EVERY`` such calls; returns the calls counted so far."""
    if activity is not None:
        activity.last = time.monotonic()
    ready += 1
    if ready % _YIELD_EVERY == 0:
        await anyio.lowlevel.checkpoint()
    return ready


async def wait_for_bytes(sock: socket.socket, idle: float | None = None) -> None:
    """Returns once ``sock`` has bytes to read (or the peer ended the stream), having read
    none; with ``idle``, raises TimeoutError when none came for that many seconds."""
    await _wait_ready(anyio.wait_readable, sock, idle)


async def send_all_views(sock: socket.socket, views: Sequence[memoryview], stall: float | None = None,
                         activity: Activity | None = None) -> None:
    """Sends every view in order (bytes ``B`` views), many per system call (``sendmsg``, up to
    ``_IOV_MAX`` buffers): a frame's payload of many small ranges costs a few calls, not one each.
    With ``stall``, a peer that takes no bytes for that many seconds ends it (TimeoutError)."""
    (i, pos), ready = _advance(views, 0, 0, 0), 0
    while i < len(views):
        try:
            sent = sock.sendmsg(_next_batch(views, i, pos))
        except BlockingIOError:
            await _wait_ready(anyio.wait_writable, sock, stall)
            continue
        i, pos = _advance(views, i, pos, sent)
        ready = await _progressed(activity, ready)


async def recv_into_views(sock: socket.socket, views: Sequence[memoryview], stall: float | None = None,
                          activity: Activity | None = None) -> None:
    """Fills every view in order (bytes ``B`` views), many per system call (``recvmsg_into``,
    up to ``_IOV_MAX`` buffers). Raises EOFError if the peer closed first; with ``stall``,
    TimeoutError when no byte arrived for that many seconds."""
    (i, pos), ready = _advance(views, 0, 0, 0), 0
    while i < len(views):
        try:
            got = sock.recvmsg_into(_next_batch(views, i, pos))[0]
        except BlockingIOError:
            await _wait_ready(anyio.wait_readable, sock, stall)
            continue
        if got == 0:
            left = len(views[i]) - pos + sum(len(v) for v in views[i + 1 :])
            raise EOFError(f"connection closed with {left} bytes outstanding")
        i, pos = _advance(views, i, pos, got)
        ready = await _progressed(activity, ready)


async def recv_exactly(sock: socket.socket, n: int, stall: float | None = None,
                       activity: Activity | None = None) -> bytes:
    """``n`` bytes from the stream (see :func:`recv_growing`)."""
    return bytes(await recv_growing(sock, n, stall, activity))


async def recv_growing(sock: socket.socket, n: int, stall: float | None = None,
                       activity: Activity | None = None) -> bytearray:
    """``n`` bytes from the stream, in a buffer that grows only with the bytes that arrived:
    each read lands in the process's shared ``_LANDING`` buffer and is appended at once, so a
    peer that announces ``n`` bytes and sends few costs what it sent, never ``n``. Raises as
    :func:`recv_into_views`."""
    buf, ready = bytearray(), 0
    while len(buf) < n:
        try:
            got = sock.recv_into(_LANDING, min(n - len(buf), len(_LANDING)))
        except BlockingIOError:
            await _wait_ready(anyio.wait_readable, sock, stall)
            continue
        if got == 0:
            raise EOFError(f"connection closed with {n - len(buf)} bytes outstanding")
        buf += _LANDING[:got]  # (no await between the read and this copy: the buffer is shared)
        ready = await _progressed(activity, ready)
    return buf


# Where discarded payload bytes go: one buffer for every connection of the process (what lands in
# it is never read), so a peer draining a refused payload costs no memory of its own.
_DISCARD = memoryview(bytearray(256 << 10))
# Where a growing read's bytes land before they are appended (shared likewise: each read is
# copied out before anything else runs).
_LANDING = memoryview(bytearray(256 << 10))


async def discard(sock: socket.socket, n: int, stall: float | None = None, activity: Activity | None = None) -> None:
    """Reads and drops ``n`` bytes (a refused payload), into the shared ``_DISCARD`` buffer."""
    while n > 0:
        k = min(n, len(_DISCARD))
        await recv_into_views(sock, [_DISCARD[:k]], stall, activity)
        n -= k


async def read_frame_head(sock: socket.socket, max_meta: int = MAX_META, *, idle: float | None = None,
                          stall: float | None = None,
                          activity: Activity | None = None) -> tuple[int, int, dict[str, Any], int]:
    """One frame's kind, request id, metadata and payload length (the payload is left unread).

    Args:
        idle: at most this many seconds without a byte before the header is complete.
        stall: likewise for the metadata, once the header is in.

    Raises:
        WireError: not a frame, metadata longer than ``max_meta`` announced (refused before any
            buffer is allocated for it), or metadata that does not decode (too deep included).
        EOFError, OSError: the connection ended; TimeoutError: ``idle`` or ``stall`` passed.
    """
    hdr = decode_header(await recv_exactly(sock, FRAME_HEADER.size, idle, activity), max_meta)
    meta = decode_meta(await recv_exactly(sock, hdr.meta_len, stall, activity))
    return hdr.kind, hdr.request_id, meta, hdr.payload_len


_TCP_INFO_BYTES = 136  # struct tcp_info up to tcpi_bytes_received (Linux >= 4.1)
_TCP_INFO_ACKED = 120  # offset of tcpi_bytes_acked (u64); tcpi_bytes_received follows


def delivery_progress(sock: socket.socket) -> int | None:
    """How many bytes this TCP connection has had acknowledged by its peer plus received from
    it (``TCP_INFO``): it grows while the link delivers in either direction, even when no
    system call moves a byte (a send buffer draining, a reply on its way). None where the
    kernel does not tell (not Linux, or the socket is closed)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError, ValueError):
        return None
    if len(info) < _TCP_INFO_BYTES:
        return None
    acked, received = int.from_bytes(info[120:128], "little"), int.from_bytes(info[128:136], "little")
    return acked + received


def abort_socket(sock: socket.socket) -> None:
    """Closes ``sock`` discarding what it has not sent (``SO_LINGER`` 0: a reset, not a
    graceful end), so that none of its queued bytes reaches the peer later, e.g. once a cut
    link comes back."""
    if sock.fileno() >= 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    close_socket(sock)


def close_socket(sock: socket.socket) -> None:
    """Closes ``sock`` now, waking any task waiting on it (with ClosedResourceError)."""
    if sock.fileno() >= 0:
        with contextlib.suppress(Exception):  # waking readers is best effort; we close anyway
            anyio.notify_closing(sock)
        sock.close()


# How a connection ends from our point of view: the peer closed or reset it, it spoke nonsense,
# or we closed the socket under a waiting task (anyio.ClosedResourceError).
CONNECTION_ENDED = (OSError, EOFError, WireError, anyio.ClosedResourceError, anyio.BrokenResourceError)

def payload_parts(views: memoryview | Sequence[memoryview] | None) -> Sequence[memoryview]:
    """A frame's payload as a sequence of views (none, one, or several back to back)."""
    if views is None:
        return ()
    return (views,) if isinstance(views, memoryview) else views
