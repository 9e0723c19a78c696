"""The tcp backend's direct lane (``csrc/tcp_direct.cpp``).

A direct-lane connection is a normal agent connection that said HELLO with lane ``"direct"``
(so it is authenticated by Python, like every other); the socket is then handed to native code
on both ends:

* the target's :class:`DirectServer` serves it on a native thread: it reads fixed-size binary
  requests, checks each against a :class:`RegionMirror` of the endpoint's host regions (kept
  current by :class:`transport._regions.RegionTable`) and moves the bytes between the socket and
  the region with no Python on the path;
* the initiator's :class:`DirectLane` carries one request at a time and drives it on the calling
  thread for a short bound; the rest (payload still to send, a reply still to come) is driven
  when the event loop sees the socket writable or readable (:meth:`DirectLane.finish`).
"""

from __future__ import annotations

import enum
import socket

from .._errors import TransportInternalError
from ._extension import _C

MAX_KEY_BYTES = 255  # a request's key, encoded (csrc/tcp_direct.h kMaxKey)
MAX_DTYPE_BYTES = 32


class LaneResult(enum.IntEnum):
    """What a direct-lane request came to (``DirectLane::Result``)."""

    DONE = 0  # the bytes are in place
    PENDING = 1  # not finished yet: call finish() when the socket is ready (``writing`` says which way)
    REFUSED = 2  # the target refused it; nothing was written (``message`` says why)
    BROKEN = 3  # the connection failed; the lane is closed (``message`` says how)


class RegionMirror:
    """The host regions one endpoint has registered, as its direct-lane threads see them."""

    def __init__(self) -> None:
        self._m = _C.RegionMirror()

    def set(self, key: str, address: int, nbytes: int, itemsize: int, writable: bool, dtype: str) -> None:
        self._m.set(key, address, nbytes, itemsize, writable, dtype)

    def remove(self, key: str, token: int) -> bool:
        """Withdraws ``key``; True when a request still moves its bytes: keep its memory alive
        until :meth:`released` returns ``token``."""
        return bool(self._m.remove(key, token))

    def mark_moved(self, key: str) -> None:
        """Refuses transfers into ``key`` from now on: its tensor was given new storage."""
        self._m.mark_moved(key)

    def released(self) -> list[int]:
        """Tokens of withdrawn regions no request uses any more (each reported once)."""
        return list(self._m.released())

    def clear(self) -> None:
        self._m.clear()

    @property
    def native(self) -> _C.RegionMirror:
        return self._m


class DirectServer:
    """Serves direct-lane connections on native threads (one each, at most ``max_conns``).

    Args:
        mirror: the regions requests may touch.
        owner: the endpoint's name (for refusal messages).
        io_timeout: seconds one request may take once its first byte arrived; a slower one
            (a stalled or hostile sender) ends its connection.
        max_conns: connections served at once; more are closed at adoption.
    """

    def __init__(self, mirror: RegionMirror, owner: str, io_timeout: float, max_conns: int) -> None:
        self._s = _C.DirectServer(mirror.native, owner, io_timeout, max_conns)

    def adopt(self, sock: socket.socket) -> bool:
        """Takes over ``sock`` (detached from it). False: not served (closed, or at the cap);
        the socket is closed then."""
        return bool(self._s.adopt(sock.detach()))

    @property
    def connections(self) -> int:
        return int(self._s.connections)

    @property
    def served(self) -> int:
        """Requests served so far."""
        return int(self._s.served)

    def close(self) -> None:
        """Ends every connection and joins the threads. Idempotent."""
        self._s.close()


class DirectLane:
    """The initiator's end of one direct-lane connection: one request at a time. A call never
    blocks longer than the ``wait`` it is given, whatever the peer does: what the socket does
    not take or have ready by then is left for :meth:`finish`.

    Args:
        sock: the connected socket, after its HELLO was accepted (detached from it here).
    """

    def __init__(self, sock: socket.socket) -> None:
        self._lane = _C.DirectLane(sock.detach())
        self.completed = 0  # requests that came back (done or refused)

    def start(self, put: bool, key: str, dtype: str, offset: int, nbytes: int, local: int,
              wait: float) -> LaneResult:
        """Starts one request (a put's payload read from address ``local``; a get's reply lands
        there; the memory must stay valid until it is done) and drives it for up to ``wait``
        seconds: sending it, then reading its reply. ``key`` and ``dtype`` must fit
        (:data:`MAX_KEY_BYTES`, :data:`MAX_DTYPE_BYTES`, checked by the caller)."""
        try:
            return self._count(LaneResult(self._lane.start(1 if put else 2, key, dtype, offset, nbytes, local, wait)))
        except (ValueError, RuntimeError) as exc:
            raise TransportInternalError(f"direct lane: {exc}") from exc

    def finish(self, wait: float) -> LaneResult:
        """Drives the pending request for up to ``wait`` seconds more."""
        return self._count(LaneResult(self._lane.finish(wait)))

    def _count(self, result: LaneResult) -> LaneResult:
        if result in (LaneResult.DONE, LaneResult.REFUSED):
            self.completed += 1
        return result

    @property
    def pending(self) -> bool:
        return bool(self._lane.pending)

    @property
    def writing(self) -> bool:
        """Whether the pending request still has bytes to send (wait until the socket is
        writable), rather than waiting for its reply (readable)."""
        return bool(self._lane.writing)

    @property
    def closed(self) -> bool:
        return bool(self._lane.closed)

    def fileno(self) -> int:
        return int(self._lane.fd)

    @property
    def message(self) -> str:
        return str(self._lane.message)

    def close(self) -> None:
        self._lane.close()
