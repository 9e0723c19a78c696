"""The agent: each Transport's background server (connections to other agents: ``_channel``).

Every Transport listens on one TCP port, or one per address it is given (one per NIC: the
``tcp`` backend stripes large transfers over them), all published in its peer record and all
served alike. Connections carry
frames (see :mod:`transport._wire`): HELLO once, then PUT / GET / SIGNAL requests, each answered
by OK / DATA / ERR with the same request id. Requests are pipelined: many may be outstanding
on one connection, and a reader task matches replies to them.

The agent authenticates connections and dispatches their requests to a :class:`Routes` object
(signals, backends' control requests, and every other frame to the backend that serves its
kind, ``Backend.serve_frame``); it touches no region and names no backend itself.

Anyone who can reach the port can connect, so what a connection may cost is bounded before it
authenticates, and nothing one connection does stops the others:

* the HELLO must arrive complete within ``handshake_timeout`` s with at most PRE_AUTH_META bytes
  of metadata (checked in the header, before allocating) and no payload, or the connection closes;
* at most ``max_preauth`` connections wait for their HELLO: a new one closes the *oldest* waiting
  one (an honest client says HELLO at once, so idle sockets cannot lock it out);
* at most ``max_conns`` are open in all. A new one beyond that (or one that ``accept`` cannot take
  for want of descriptors) is made room for: the agent closes the *stalest* connection, the one
  that has gone longest without moving a byte in either direction (a connection waiting for its
  HELLO counts from when it was accepted), unless that one has bytes waiting to be read. So idle
  connections, authenticated ones included, can never lock a peer out, whoever holds them (a
  token holder, or anyone where no token is set, under as many names as it likes). An honest
  client whose idle connection was closed opens a new one for its next request. Watch
  connections are never closed to make room (closing one tells its peer that this process
  died); at most ``max_conns // 2`` may be open, and one more is refused with an ERR (its peer
  then learns of this process's end from heartbeats);
* after HELLO, one peer (the name its HELLO gives) holds at most ``max_conns_per_peer``
  connections: one more is refused with an ERR naming the cap; an honest Transport holds three
  or four per peer;
* a connection on which nothing arrives for ``idle_timeout`` s, between frames or inside one (a
  stalled payload or metadata), or that takes no reply bytes for that long, is closed. The HELLO's
  OK carries ``idle_s``, and clients reopen a channel idle for half of it before they use it, so
  an honest client never writes into a connection being closed. Watch connections (a peer
  waiting for this process to end, ``lane="watch"``) are exempt between frames: idling is their job;
* a refused payload is drained into one buffer shared by every connection, and every buffer
  whose size a peer announced (metadata, a run table, a staged payload) grows only with the
  bytes that arrive: what a stalled connection costs is what it sent;
* defaults 1024 / 64 / 10 s / 32 / 300 s; ``$TRANSPORT_AGENT_MAX_CONNS``, ``$TRANSPORT_AGENT_MAX_PREAUTH``,
  ``$TRANSPORT_AGENT_HANDSHAKE_TIMEOUT``, ``$TRANSPORT_AGENT_MAX_CONNS_PER_PEER`` and
  ``$TRANSPORT_AGENT_IDLE_TIMEOUT`` (read when the server is made) or the fields override them;
* a failing ``accept`` never stops the listener: out of descriptors, it makes room as above and
  accepts again; with nothing to close (or out of memory) it warns (rate-limited) and retries
  after 0.1 s; an aborted connection is skipped;
* an undecodable or oversized frame (WireError, JSON nested too deep included) or any unexpected
  error closes that connection only; a garbled reply fails that channel's requests with PeerLostError.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ._auth import Authenticator
from ._errors import AuthenticationError, BackendUnavailableError, TransportError, WireError
from ._listen import listening_socket
from ._sockets import (
    CONNECTION_ENDED,
    Activity,
    close_socket,
    discard,
    payload_parts,
    read_frame_head,
    recv_growing,
    recv_into_views,
    send_all_views,
    tune_socket,
    wait_for_bytes,
)
from ._wire import (
    PRE_AUTH_META,
    ErrCode,
    FrameKind,
    SignalRequest,
    encode_frame,
    error_to_frame,
    kind_name,
)

log = logging.getLogger(__name__)

MAX_CONNS_ENV = "TRANSPORT_AGENT_MAX_CONNS"
MAX_PREAUTH_ENV = "TRANSPORT_AGENT_MAX_PREAUTH"
HANDSHAKE_TIMEOUT_ENV = "TRANSPORT_AGENT_HANDSHAKE_TIMEOUT"
MAX_CONNS_PER_PEER_ENV = "TRANSPORT_AGENT_MAX_CONNS_PER_PEER"
IDLE_TIMEOUT_ENV = "TRANSPORT_AGENT_IDLE_TIMEOUT"
DEFAULT_MAX_CONNS = 1024
DEFAULT_MAX_PREAUTH = 64
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
DEFAULT_MAX_CONNS_PER_PEER = 32
DEFAULT_IDLE_TIMEOUT = 300.0
WATCH_LANE = "watch"  # a connection that only waits for this process to end (see PeerDirectory.watch)
_ACCEPT_BACKOFF_S = 0.1
_WARN_EVERY_S = 10.0
# accept(2) passes on errors of the connection it was about to return: skip that connection.
_CONNECTION_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.EHOSTUNREACH})
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


# ---------------------------------------------------------------------------------------------
# Server side


class Conn:
    """The serving side of one agent connection, as a route sees it."""

    def __init__(self, sock: socket.socket, stall: float | None = None) -> None:
        self.sock = sock
        self.stall = stall  # seconds without progress after which a read or a reply gives up
        self.activity = Activity()  # when it last moved a byte (the agent makes room by it)
        # True while the agent waits for its next frame having read no byte of it (and with every
        # reply sent): closing it then can tell its peer that nothing unanswered was carried out.
        self.between_frames = False

    async def reply(self, kind: FrameKind, rid: int, meta: Mapping[str, Any],
                    payload: memoryview | Sequence[memoryview] | None = None) -> None:
        parts = payload_parts(payload)
        frame = encode_frame(kind, rid, meta, sum(len(p) for p in parts))
        await send_all_views(self.sock, [memoryview(frame), *parts], self.stall, self.activity)

    async def reply_head(self, kind: FrameKind, rid: int, meta: Mapping[str, Any], nbytes: int) -> None:
        """Starts a reply whose ``nbytes`` of payload follow by :meth:`send` (made as they are
        sent: a peer that stops reading then holds one part, never the whole payload). The
        caller sends exactly ``nbytes``, or raises (the connection closes: it is out of step)."""
        await send_all_views(self.sock, [memoryview(encode_frame(kind, rid, meta, nbytes))], self.stall, self.activity)

    async def send(self, views: Sequence[memoryview]) -> None:
        """Sends ``views`` (bytes views) in order: payload bytes of a reply begun by :meth:`reply_head`."""
        await send_all_views(self.sock, views, self.stall, self.activity)

    async def refuse(self, rid: int, exc: TransportError, *, discard: int = 0) -> None:
        """Answers request ``rid`` with ``exc``'s refusal code, after reading past the ``discard``
        payload bytes left of it (the connection stays usable)."""
        await self.discard(discard)
        code, msg = error_to_frame(exc)
        await self.reply(FrameKind.ERR, rid, {"code": code, "message": msg})

    async def recv_into(self, views: Sequence[memoryview]) -> None:
        """Fills ``views`` (bytes views) in order from the stream, many per system call."""
        await recv_into_views(self.sock, views, self.stall, self.activity)

    async def recv_bytes(self, nbytes: int) -> bytearray:
        """``nbytes`` from the stream into a new buffer that grows only with what arrives."""
        return await recv_growing(self.sock, nbytes, self.stall, self.activity)

    async def discard(self, nbytes: int) -> None:
        if nbytes:
            await discard(self.sock, nbytes, self.stall, self.activity)


class Routes(Protocol):
    """Where the agent sends each request after HELLO; the agent itself touches no region."""

    def signal(self, request: SignalRequest) -> None:
        """SIGNAL: sets a signal here."""

    async def backend_request(self, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        """BACKEND: a backend's own request (``meta["backend"]`` names it); returns the reply's
        metadata or raises TransportError."""

    def serves(self, kind: int, meta: Mapping[str, Any]) -> bool:
        """Whether a backend here serves frames like this one (else it is a protocol error)."""

    async def frame(self, conn: Conn, kind: int, rid: int, meta: Mapping[str, Any], payload_len: int) -> None:
        """Any other frame (PUT / GET ... of ``tcp``, a backend's own data request): the backend
        that serves its kind takes its payload and replies on ``conn``."""

    def takes_lane(self, lane: str) -> bool:
        """Whether a backend takes over connections whose HELLO asks for ``lane``."""

    def adopt_lane(self, lane: str, sock: socket.socket) -> bool:
        """A connection whose HELLO asked for such a lane: the backend (its native code) takes
        the socket over (detaching it). False: not served; the socket is closed then."""


def _env_limit(name: str, default: float) -> float:
    raw = os.environ.get(name) or str(default)
    with contextlib.suppress(ValueError):
        if 0 < (value := float(raw)) < math.inf:
            return value
    raise ValueError(f"${name} must be a positive number, got {raw!r}")


@dataclass
class AgentServer:
    """Accepts agent connections for the endpoint ``name`` (``incarnation``), authenticates
    them, and dispatches their requests to ``routes``; the limits are the module docstring's
    (for all its listening addresses together).

    It listens on ``host:port`` and on every address of ``more`` (one per further NIC).

    Raises:
        ValueError: a limit (or its environment variable) is not a positive number.
        OSError: ``host:port`` cannot be bound.
    """

    name: str
    incarnation: str
    auth: Authenticator
    routes: Routes
    host: str = "127.0.0.1"
    port: int = 0
    max_conns: int = field(default_factory=lambda: int(_env_limit(MAX_CONNS_ENV, DEFAULT_MAX_CONNS)))
    max_preauth: int = field(default_factory=lambda: int(_env_limit(MAX_PREAUTH_ENV, DEFAULT_MAX_PREAUTH)))
    handshake_timeout: float = field(
        default_factory=lambda: _env_limit(HANDSHAKE_TIMEOUT_ENV, DEFAULT_HANDSHAKE_TIMEOUT))
    max_conns_per_peer: int = field(
        default_factory=lambda: int(_env_limit(MAX_CONNS_PER_PEER_ENV, DEFAULT_MAX_CONNS_PER_PEER)))
    idle_timeout: float = field(default_factory=lambda: _env_limit(IDLE_TIMEOUT_ENV, DEFAULT_IDLE_TIMEOUT))
    more: Sequence[tuple[str, int]] = ()

    def __post_init__(self) -> None:
        if not (self.max_conns >= 1 and self.max_preauth >= 1 and self.max_conns_per_peer >= 1
                and 0 < self.handshake_timeout < math.inf and 0 < self.idle_timeout < math.inf):
            raise ValueError(f"agent limits must be positive, got max_conns={self.max_conns!r}, "
                             f"max_preauth={self.max_preauth!r}, handshake_timeout={self.handshake_timeout!r}, "
                             f"max_conns_per_peer={self.max_conns_per_peer!r}, idle_timeout={self.idle_timeout!r}")
        self._lsocks: list[socket.socket] = []
        try:
            for host, port in [(self.host, self.port), *self.more]:
                self._lsocks.append(listening_socket(host, port))
        except BaseException:
            for s in self._lsocks:
                s.close()
            raise
        self.port = self._lsocks[0].getsockname()[1]
        self._addresses = tuple((host, s.getsockname()[1])
                                for (host, _), s in zip([(self.host, 0), *self.more], self._lsocks, strict=True))
        self._conns: dict[socket.socket, anyio.CancelScope] = {}  # every open connection's task
        self._waiting: dict[socket.socket, float] = {}  # those still waiting for HELLO -> accepted when, oldest first
        self._serving: dict[socket.socket, Conn] = {}  # those past HELLO that may be closed to make room
        self._watching: set[socket.socket] = set()  # watch connections (never closed to make room)
        self._by_peer: dict[str, set[socket.socket]] = {}  # authenticated connections per HELLO name
        self._peer_of: dict[socket.socket, str] = {}
        self._warned: dict[str, tuple[float, int]] = {}  # kind of warning -> (when last logged, since)

    @property
    def address(self) -> tuple[str, int]:
        """The first address it listens on (where control connections go)."""
        return (self.host, self.port)

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        """Every address it listens on, :attr:`address` first."""
        return self._addresses

    @property
    def max_watch(self) -> int:
        """Watch connections open at once, at most (they are never closed to make room)."""
        return max(1, self.max_conns // 2)

    async def serve(self, tg: TaskGroup, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Accepts connections on every listening address until cancelled (or :meth:`close`),
        serving each in a task of ``tg``; no accept error and nothing a connection does ends
        it. Cancelling it closes the listening sockets and every connection."""
        task_status.started()
        try:
            async with anyio.create_task_group() as accepting:
                for lsock in self._lsocks:
                    accepting.start_soon(self._accept_loop, tg, lsock)
        finally:
            self.close()

    async def _accept_loop(self, tg: TaskGroup, lsock: socket.socket) -> None:
        try:
            while lsock.fileno() >= 0:
                await anyio.wait_readable(lsock)
                try:
                    sock, addr = lsock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    if exc.errno in _OUT_OF_DESCRIPTORS and (closed := self._make_room()):
                        self._warn("accept", f"accept failed ({exc}) with {len(self._conns) + 1} connections open: "
                                   f"closed {closed} to make room")
                    elif exc.errno not in _CONNECTION_GONE:  # out of memory, or nothing to close, or unforeseen:
                        # the connection stays queued, so retrying at once would spin
                        self._warn("accept", f"accept failed ({exc}) with {len(self._conns)} connections open; "
                                   f"retrying in {_ACCEPT_BACKOFF_S:g}s")
                        await anyio.sleep(_ACCEPT_BACKOFF_S)
                    continue
                self._admit(tg, sock, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr))
        except anyio.ClosedResourceError:
            pass  # closed under us

    def close(self) -> None:
        for s in [*self._lsocks, *self._conns]:
            close_socket(s)
        self._conns.clear()
        self._waiting.clear()
        self._serving.clear()
        self._watching.clear()
        self._by_peer.clear()
        self._peer_of.clear()

    def _warn(self, kind: str, what: str) -> None:
        """Logs a warning about load or abuse, at most one of each kind per _WARN_EVERY_S."""
        now = time.monotonic()
        last, unsaid = self._warned.get(kind, (-math.inf, 0))
        if now - last < _WARN_EVERY_S:
            self._warned[kind] = (last, unsaid + 1)
            return
        self._warned[kind] = (now, 0)
        log.warning("agent %s: %s%s", self.name, what, f" ({unsaid} more since the last)" if unsaid else "")

    def _admit(self, tg: TaskGroup, sock: socket.socket, peer: str) -> None:
        if len(self._waiting) >= self.max_preauth:
            self._warn("preauth", f"{len(self._waiting)} connections waiting for their HELLO, {len(self._conns)} open: "
                       f"closing the oldest waiting one (cap ${MAX_PREAUTH_ENV})")
            self._drop(next(iter(self._waiting)))
        if len(self._conns) >= self.max_conns:
            closed = self._make_room()
            if closed is None:  # every one is a watch connection, or has bytes waiting
                self._warn("cap", f"closed a new connection from {peer}: {len(self._conns)} connections are open "
                           f"(the cap; ${MAX_CONNS_ENV}) and none is idle")
                close_socket(sock)
                return
            self._warn("cap", f"{len(self._conns) + 1} connections open (the cap; ${MAX_CONNS_ENV}): closed {closed} "
                       f"to make room for one from {peer}")
        try:
            tune_socket(sock)
        except OSError:  # reset before we got to it
            close_socket(sock)
            return
        scope = anyio.CancelScope()
        self._conns[sock] = scope
        self._waiting[sock] = time.monotonic()
        tg.start_soon(self._serve_conn, sock, scope, peer)

    def _make_room(self) -> str | None:
        """Closes the stalest connection: of the one waiting longest for its HELLO and the
        served one that moved no byte for longest (read or written; watch connections are
        never closed here), whichever has been silent longer. A served connection with bytes
        waiting to be read is not silent (its request just came): it counts as active now.
        Returns what was closed, for the log, or None when nothing could be."""
        now = time.monotonic()
        for _ in range(8):  # each pass either closes one or marks one active: bounded
            waiting = next(iter(self._waiting.items()), None)
            served = min(self._serving.items(), key=lambda item: item[1].activity.last, default=None)
            if served is not None and (waiting is None or served[1].activity.last < waiting[1]):
                sock, conn = served
                if _has_bytes_waiting(sock):
                    conn.activity.touch()
                    continue
                who = self._peer_of.get(sock, "?")
                if conn.between_frames:  # nothing of a next request read: its peer may send it again elsewhere
                    _say_going_away(sock, f"{self.name} closed this connection, idle for "
                                    f"{now - conn.activity.last:.1f}s, to make room for a new one")
                self._drop(sock)
                return f"the connection from {who!r} idle for {now - conn.activity.last:.1f}s"
            if waiting is not None:
                self._drop(waiting[0])
                return f"a connection waiting {now - waiting[1]:.1f}s for its HELLO"
            return None
        return None

    def _drop(self, sock: socket.socket) -> None:
        """Forgets a connection and closes it (stopping its task if it still runs)."""
        self._waiting.pop(sock, None)
        self._unclaim(sock)
        scope = self._conns.pop(sock, None)
        if scope is not None:
            scope.cancel()
        close_socket(sock)

    def _unclaim(self, sock: socket.socket) -> None:
        """Stops counting ``sock`` against its peer's cap, and as served or watching."""
        self._serving.pop(sock, None)
        self._watching.discard(sock)
        who = self._peer_of.pop(sock, None)
        if who is not None:
            socks = self._by_peer[who]
            socks.discard(sock)
            if not socks:
                del self._by_peer[who]

    async def _serve_conn(self, sock: socket.socket, scope: anyio.CancelScope, peer: str) -> None:
        conn = Conn(sock, self.idle_timeout)
        try:
            with scope:
                accepted, lane = False, ""
                with anyio.move_on_after(self.handshake_timeout) as handshake:
                    peer, accepted, lane = await self._handshake(conn, peer)
                if not accepted:
                    log.debug("agent %s: closing the connection from %s (%s)", self.name, peer,
                              "no HELLO in time" if handshake.cancelled_caught else "refused")
                    return
                if lane and self.routes.takes_lane(lane):  # a backend's native code serves it (or closes it)
                    self._conns.pop(sock, None)
                    self._unclaim(sock)
                    if not self.routes.adopt_lane(lane, sock):
                        self._warn("lane", f"closed the {lane} lane from {peer}: not served (at its cap)")
                    return
                idle = None if lane == WATCH_LANE else self.idle_timeout
                if lane != WATCH_LANE:
                    self._serving[sock] = conn
                while True:
                    conn.between_frames = True
                    try:
                        await wait_for_bytes(sock, idle)
                    finally:
                        conn.between_frames = False
                    kind, rid, meta, plen = await read_frame_head(sock, idle=self.idle_timeout, stall=self.idle_timeout,
                                                                  activity=conn.activity)
                    await self._dispatch(conn, kind, rid, meta, plen)
                    conn.activity.touch()  # (a route may have worked a while without moving a byte)
        except CONNECTION_ENDED as exc:
            log.debug("agent %s: connection from %s ended: %s", self.name, peer, exc)
        except Exception:  # a route's bug or an unforeseen input: this connection only
            log.warning("agent %s: closing the connection from %s after an unexpected error", self.name, peer,
                        exc_info=True)
        finally:
            self._drop(sock)

    async def _handshake(self, conn: Conn, peer: str) -> tuple[str, bool, str]:
        """Reads and answers the HELLO; returns who it says it is, whether it was accepted, and
        the lane it asked for (``"direct"``: the tcp direct lane's native server takes it over).
        Raises WireError if the first frame is not a HELLO of PRE_AUTH_META bytes and no payload."""
        kind, rid, meta, plen = await read_frame_head(conn.sock, PRE_AUTH_META)
        if kind != FrameKind.HELLO or plen:
            raise WireError(f"connection did not start with HELLO (got {kind_name(kind)} with {plen} payload bytes)")
        peer = f"{str(meta.get('from', '?'))[:200]} ({peer})"
        if meta.get("to_incarnation") != self.incarnation:
            await conn.reply(FrameKind.ERR, rid, {
                "code": ErrCode.STALE,
                "message": f"{self.name} is incarnation {self.incarnation}, "
                f"not {str(meta.get('to_incarnation'))[:200]} (it restarted; fetch its record again)",
            })
            return peer, False, ""
        try:
            self.auth.check_hello(meta, self.name, self.incarnation)
        except AuthenticationError as exc:
            self._warn("auth", f"refused a connection from {peer}: {exc}")
            await conn.reply(FrameKind.ERR, rid, {"code": ErrCode.AUTH, "message": str(exc)})
            return peer, False, ""
        self._waiting.pop(conn.sock, None)  # authenticated: no longer waiting
        lane = meta.get("lane")
        lane = lane if isinstance(lane, str) else ""
        if lane == WATCH_LANE and len(self._watching) >= self.max_watch:
            self._warn("watch", f"refused a watch connection from {peer}: {len(self._watching)} are open (the cap "
                       f"for watch connections, half of ${MAX_CONNS_ENV})")
            await conn.reply(FrameKind.ERR, rid, {
                "code": ErrCode.INTERNAL,
                "message": f"{self.name} holds {len(self._watching)} watch connections, its cap; watch it through "
                "heartbeats"})
            return peer, False, ""
        who = str(meta.get("from", "?"))[:200]
        mine = self._by_peer.get(who, set())
        if len(mine) >= self.max_conns_per_peer:
            self._warn("per-peer", f"refused a connection from {peer}: it holds {len(mine)} connections "
                       f"(the cap per peer; ${MAX_CONNS_PER_PEER_ENV})")
            await conn.reply(FrameKind.ERR, rid, {
                "code": ErrCode.INTERNAL,
                "message": f"{self.name} holds {len(mine)} connections from {who!r}, its cap per peer "
                f"(${MAX_CONNS_PER_PEER_ENV})"})
            return peer, False, ""
        self._by_peer[who] = mine | {conn.sock}
        self._peer_of[conn.sock] = who
        if lane == WATCH_LANE:
            self._watching.add(conn.sock)
        await conn.reply(FrameKind.OK, rid, {"incarnation": self.incarnation, "idle_s": self.idle_timeout,
                                             **self.auth.ok_fields(meta, self.incarnation)})
        return peer, True, lane

    async def _dispatch(self, conn: Conn, kind: int, rid: int, meta: dict[str, Any], plen: int) -> None:
        if kind == FrameKind.SIGNAL:
            await conn.discard(plen)
            try:
                signal = SignalRequest.from_meta(meta)
            except WireError:
                await conn.reply(FrameKind.ERR, rid, {"code": ErrCode.BAD_REQUEST, "message": "bad SIGNAL"})
                return
            self.routes.signal(signal)
            await conn.reply(FrameKind.OK, rid, {})
            return
        if kind == FrameKind.BACKEND:
            await conn.discard(plen)
            try:
                answer = await self.routes.backend_request(meta)
            except TransportError as exc:
                await conn.refuse(rid, exc)
                return
            await conn.reply(FrameKind.OK, rid, answer)
            return
        if kind in (FrameKind.HELLO, FrameKind.OK, FrameKind.DATA, FrameKind.ERR):
            raise WireError(f"unexpected {kind_name(kind)} request")
        if not self.routes.serves(kind, meta):
            if kind != FrameKind.BACKEND_DATA:
                raise WireError(f"unexpected {kind_name(kind)} request")
            await conn.refuse(rid, BackendUnavailableError(  # a backend's own request for one not run here
                f"{self.name} does not run backend {str(meta.get('backend'))[:100]!r}"), discard=plen)
            return
        await self.routes.frame(conn, kind, rid, meta, plen)


def _say_going_away(sock: socket.socket, why: str) -> None:
    """Tells the peer of ``sock``, if its socket takes the frame at once, that the agent closes
    the connection having carried out nothing since its last reply (ErrCode.GOING_AWAY)."""
    frame = encode_frame(FrameKind.ERR, 0, {"code": ErrCode.GOING_AWAY, "message": why}, 0)
    with contextlib.suppress(OSError):  # full or broken: the peer sees the connection close, as before
        if sock.send(frame, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) == len(frame):
            sock.shutdown(socket.SHUT_WR)  # the end of the stream right after it


def _has_bytes_waiting(sock: socket.socket) -> bool:
    """Whether bytes (or the peer's end of the stream) wait to be read on ``sock``, now."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:  # reset: closing it costs nothing
        return False
