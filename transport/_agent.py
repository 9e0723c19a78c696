"""The agent: each Transport's background server, and client connections to other agents.

Every Transport listens on one TCP port (published in its peer record). Connections carry
frames (see :mod:`transport._wire`): HELLO once, then PUT / GET / SIGNAL requests, each answered
by OK / DATA / ERR with the same request id. Requests are pipelined: many may be outstanding
on one connection, and a reader task matches replies to them.

The agent authenticates connections and dispatches their requests to a :class:`Routes` object
(signals, backends' own requests, and the ``tcp`` backend's byte ranges); it touches no region
itself.

Sockets are raw non-blocking sockets driven by ``anyio.wait_readable/wait_writable``, so the
same code runs under trio and asyncio and ``recv_into`` lands data in place without copies.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ._auth import Authenticator
from ._errors import (
    AuthenticationError,
    BoundsError,
    ClosedError,
    DTypeMismatchError,
    PeerLostError,
    ReadOnlyRegionError,
    RegistrationError,
    TransferTimeoutError,
    TransportError,
    TransportInternalError,
)
from ._wire import (
    FRAME_HEADER,
    ErrCode,
    FrameKind,
    RangeRequest,
    SignalRequest,
    WireError,
    decode_header,
    decode_meta,
    encode_frame,
)

log = logging.getLogger(__name__)

_IO_CHUNK = 4 << 20  # bytes per send/recv call; bounds how long one call holds the loop
_SOCK_BUF = 4 << 20
_YIELD_EVERY = 16  # let other tasks run at least every this many ready syscalls


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass


async def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    pos, ready = 0, 0
    while pos < len(view):
        try:
            pos += sock.send(view[pos : pos + _IO_CHUNK])
        except BlockingIOError:
            await anyio.wait_writable(sock)
            continue
        ready += 1
        if ready % _YIELD_EVERY == 0:
            await anyio.lowlevel.checkpoint()


async def recv_into_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from the socket. Raises EOFError if the peer closed first."""
    pos, ready, n = 0, 0, len(view)
    while pos < n:
        try:
            got = sock.recv_into(view[pos : pos + _IO_CHUNK])
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        if got == 0:
            raise EOFError(f"connection closed with {n - pos} of {n} bytes outstanding")
        pos += got
        ready += 1
        if ready % _YIELD_EVERY == 0:
            await anyio.lowlevel.checkpoint()


async def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    await recv_into_exactly(sock, memoryview(buf))
    return bytes(buf)


async def discard(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, _IO_CHUNK)))
    while n > 0:
        k = min(n, len(scratch))
        await recv_into_exactly(sock, scratch[:k])
        n -= k


async def read_frame_head(sock: socket.socket) -> tuple[FrameKind, int, dict[str, Any], int]:
    hdr = decode_header(await recv_exactly(sock, FRAME_HEADER.size))
    meta = decode_meta(await recv_exactly(sock, hdr.meta_len))
    return hdr.kind, hdr.request_id, meta, hdr.payload_len


async def connect(address: tuple[str, int]) -> socket.socket:
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        _tune(sock)
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


# How a connection ends from our point of view: the peer closed or reset it, it spoke nonsense,
# or we closed the socket under a waiting task (anyio.ClosedResourceError).
_CONNECTION_ENDED = (OSError, EOFError, WireError, anyio.ClosedResourceError, anyio.BrokenResourceError)


# ---------------------------------------------------------------------------------------------
# Errors carried in ERR frames


def error_to_frame(exc: TransportError) -> tuple[ErrCode, str]:
    for cls, code in (
        (ReadOnlyRegionError, ErrCode.READ_ONLY),
        (DTypeMismatchError, ErrCode.DTYPE),
        (BoundsError, ErrCode.BOUNDS),
        (RegistrationError, ErrCode.UNKNOWN_KEY),
    ):
        if isinstance(exc, cls):
            return code, str(exc)
    return ErrCode.INTERNAL, str(exc)


def frame_to_error(meta: Mapping[str, Any], peer: str) -> TransportError:
    code = meta.get("code", ErrCode.INTERNAL)
    msg = f"{peer} refused: {meta.get('message', '')}"
    cls = {
        ErrCode.DTYPE: DTypeMismatchError,
        ErrCode.BOUNDS: BoundsError,
        ErrCode.UNKNOWN_KEY: RegistrationError,
        ErrCode.READ_ONLY: ReadOnlyRegionError,
        ErrCode.STALE: PeerLostError,
        ErrCode.AUTH: AuthenticationError,
    }.get(code, TransportInternalError)
    return cls(msg)


# ---------------------------------------------------------------------------------------------
# Client side


class _Reply:
    __slots__ = ("error", "event", "into", "kind", "meta")

    def __init__(self, into: memoryview | None) -> None:
        self.event = anyio.Event()
        self.into = into
        self.kind: FrameKind | None = None
        self.meta: dict[str, Any] = {}
        self.error: BaseException | None = None


class Channel:
    """One connection to a peer's agent, with pipelined requests.

    Create with :meth:`open`. A broken channel (EOF, reset, protocol error, or a send that
    overran its deadline) fails every outstanding request with :class:`PeerLostError` and
    refuses new ones; open a new channel to retry.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self.peer = peer
        self._ids = itertools.count(1)
        self._replies: dict[int, _Reply] = {}
        self._send_lock = anyio.Lock()
        self._broken: BaseException | None = None
        self._closed = anyio.Event()

    @classmethod
    async def open(
        cls,
        tg: TaskGroup,
        address: tuple[str, int],
        *,
        peer: str,
        peer_incarnation: str,
        hello: Mapping[str, Any],
        auth: Authenticator,
    ) -> Channel:
        """Connects, says HELLO to the expected incarnation, starts the reply reader.

        Raises:
            PeerLostError: the agent is unreachable, or it is another incarnation.
            AuthenticationError: either side lacks the shared token.
        """
        try:
            sock = await connect(address)
        except OSError as exc:
            raise PeerLostError(f"cannot reach the agent of {peer} at {address[0]}:{address[1]}: {exc}") from exc
        return await cls.greet(tg, sock, peer=peer, peer_incarnation=peer_incarnation, hello=hello, auth=auth)

    @classmethod
    async def greet(
        cls,
        tg: TaskGroup,
        sock: socket.socket,
        *,
        peer: str,
        peer_incarnation: str,
        hello: Mapping[str, Any],
        auth: Authenticator,
    ) -> Channel:
        """Says HELLO on a connected ``sock`` (see :meth:`open`, which connects first); the
        channel owns the socket from here on, and closes it if the handshake fails.

        Raises:
            PeerLostError: the connection broke, or another incarnation answered.
            AuthenticationError: either side lacks the shared token.
            TransportError: any other refusal, or the HELLO could not be sent in time.
        """
        chan = cls(sock, peer)
        meta = {**hello, "to": peer, "to_incarnation": peer_incarnation}
        meta.update(auth.hello_fields(meta["from"], meta["from_incarnation"], peer, peer_incarnation))
        try:
            tg.start_soon(chan._read_loop)
            reply = await chan.request(FrameKind.HELLO, meta)
            auth.check_ok(reply, meta, peer, peer_incarnation)
        except BaseException:
            chan.close()
            raise
        return chan

    @property
    def broken(self) -> bool:
        return self._broken is not None

    async def wait_closed(self) -> BaseException:
        """Waits until the connection is closed or broken; returns why (a PeerLostError when
        the other side went away, a ClosedError when we closed it)."""
        await self._closed.wait()
        assert self._broken is not None
        return self._broken

    def close(self, reason: BaseException | None = None) -> None:
        if self._broken is None:
            self._broken = reason or ClosedError(f"connection to {self.peer} closed")
        self._closed.set()
        for reply in self._replies.values():
            if not reply.event.is_set():
                reply.error = self._broken
                reply.event.set()
        self._replies.clear()
        if self._sock.fileno() >= 0:
            with contextlib.suppress(Exception):  # waking readers is best effort; we close anyway
                anyio.notify_closing(self._sock)
            self._sock.close()

    def _lost(self, what: str, cause: BaseException | None) -> PeerLostError:
        err = PeerLostError(f"connection to {self.peer} lost: {what}")
        err.__cause__ = cause
        return err

    async def request(
        self,
        kind: FrameKind,
        meta: Mapping[str, Any],
        payload: memoryview | None = None,
        into: memoryview | None = None,
    ) -> dict[str, Any]:
        """Sends one request and waits for its reply; returns the reply's metadata.

        ``payload`` is sent after the frame; ``into`` receives a DATA reply's payload in place.
        Once a frame has started on the wire it is finished (shielded, bounded by the caller's
        deadline): cancelling before that sends nothing; cancelling after it only stops the wait.

        Raises:
            PeerLostError: the connection broke (before or during this request).
            TransferTimeoutError: the frame could not be sent by the caller's deadline.
            TransportError subclasses: the agent refused (mapped from the ERR frame).
        """
        if self._broken is not None:
            raise self._lost("earlier failure", self._broken)
        rid = next(self._ids)
        reply = _Reply(into)
        self._replies[rid] = reply
        frame = encode_frame(kind, rid, meta, len(payload) if payload is not None else 0)
        deadline = anyio.current_effective_deadline()
        try:
            async with self._send_lock:
                if self._broken is not None:
                    raise self._lost("earlier failure", self._broken)
                with anyio.CancelScope(shield=True, deadline=deadline) as scope:
                    try:
                        await send_all(self._sock, frame)
                        if payload is not None:
                            await send_all(self._sock, payload)
                    except (OSError, anyio.ClosedResourceError) as exc:
                        # If the reader already saw the connection die, report that cause.
                        cause = self._broken or exc
                        err = self._lost(f"send failed: {cause}", cause)
                        self.close(err)
                        raise err from cause
                if scope.cancelled_caught:
                    # A frame cut in half leaves the stream unusable: drop the connection.
                    late = TransferTimeoutError(f"sending to {self.peer} did not finish by the deadline")
                    self.close(self._lost("send timed out", late))
                    raise late
        except BaseException:
            if not reply.event.is_set():
                self._replies.pop(rid, None)
            raise
        await reply.event.wait()
        if reply.error is not None:
            if isinstance(reply.error, PeerLostError):
                raise reply.error
            raise self._lost("connection failed", reply.error)
        if reply.kind == FrameKind.ERR:
            raise frame_to_error(reply.meta, self.peer)
        return reply.meta

    async def _read_loop(self) -> None:
        try:
            while True:
                kind, rid, meta, payload_len = await read_frame_head(self._sock)
                reply = self._replies.pop(rid, None)
                if reply is None:
                    raise WireError(f"reply to unknown request {rid}")
                if kind == FrameKind.DATA:
                    if reply.into is None or len(reply.into) != payload_len:
                        raise WireError(f"DATA of {payload_len} bytes does not match the request")
                    await recv_into_exactly(self._sock, reply.into)
                elif payload_len:
                    await discard(self._sock, payload_len)
                reply.kind, reply.meta = kind, meta
                reply.event.set()
        except _CONNECTION_ENDED as exc:
            self.close(self._lost(str(exc) or type(exc).__name__, exc))
        except anyio.get_cancelled_exc_class():
            self.close(ClosedError(f"connection to {self.peer} closed"))
            raise


# ---------------------------------------------------------------------------------------------
# Server side


class Conn:
    """The serving side of one agent connection, as a route sees it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def reply(self, kind: FrameKind, rid: int, meta: Mapping[str, Any],
                    payload: memoryview | None = None) -> None:
        await send_all(self.sock, encode_frame(kind, rid, meta, len(payload) if payload is not None else 0))
        if payload is not None:
            await send_all(self.sock, payload)

    async def refuse(self, rid: int, exc: TransportError) -> None:
        code, msg = error_to_frame(exc)
        await self.reply(FrameKind.ERR, rid, {"code": code, "message": msg})

    async def recv_into(self, view: memoryview) -> None:
        await recv_into_exactly(self.sock, view)

    async def discard(self, nbytes: int) -> None:
        if nbytes:
            await discard(self.sock, nbytes)


class Routes(Protocol):
    """Where the agent sends each request after HELLO; the agent itself touches no region."""

    def signal(self, request: SignalRequest) -> None:
        """SIGNAL: sets a signal here."""

    async def backend_request(self, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        """BACKEND: a backend's own request (``meta["backend"]`` names it); returns the reply's
        metadata or raises TransportError."""

    async def range_request(self, conn: Conn, kind: FrameKind, rid: int, request: RangeRequest,
                            payload_len: int) -> None:
        """PUT / GET (the ``tcp`` backend's target side): serves the bytes and replies on ``conn``."""


@dataclass
class AgentServer:
    """Accepts agent connections for the endpoint ``name`` (``incarnation``), authenticates
    them, and dispatches their requests to ``routes``."""

    name: str
    incarnation: str
    auth: Authenticator
    routes: Routes
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((self.host, self.port))
        self._lsock.listen(128)
        self._lsock.setblocking(False)
        self.port = self._lsock.getsockname()[1]
        self._conns: set[socket.socket] = set()

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    async def serve(self, tg: TaskGroup, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await anyio.wait_readable(self._lsock)
                try:
                    conn, _ = self._lsock.accept()
                except BlockingIOError:
                    continue
                _tune(conn)
                self._conns.add(conn)
                tg.start_soon(self._serve_conn, conn)
        finally:
            self.close()

    def close(self) -> None:
        for s in [self._lsock, *self._conns]:
            if s.fileno() >= 0:
                with contextlib.suppress(Exception):  # waking readers is best effort
                    anyio.notify_closing(s)
                s.close()
        self._conns.clear()

    async def _serve_conn(self, sock: socket.socket) -> None:
        who = "?"
        conn = Conn(sock)
        try:
            kind, rid, meta, plen = await read_frame_head(sock)
            if kind != FrameKind.HELLO or plen:
                raise WireError("connection did not start with HELLO")
            who = str(meta.get("from", "?"))
            if meta.get("to_incarnation") != self.incarnation:
                await conn.reply(FrameKind.ERR, rid, {
                    "code": ErrCode.STALE,
                    "message": f"{self.name} is incarnation {self.incarnation}, "
                    f"not {meta.get('to_incarnation')} (it restarted; fetch its record again)",
                })
                return
            try:
                self.auth.check_hello(meta, self.name, self.incarnation)
            except AuthenticationError as exc:
                log.warning("agent %s: refused a connection: %s", self.name, exc)
                await conn.reply(FrameKind.ERR, rid, {"code": ErrCode.AUTH, "message": str(exc)})
                return
            await conn.reply(FrameKind.OK, rid, {"incarnation": self.incarnation,
                                                 **self.auth.ok_fields(meta, self.incarnation)})
            while True:
                kind, rid, meta, plen = await read_frame_head(sock)
                await self._dispatch(conn, kind, rid, meta, plen)
        except _CONNECTION_ENDED as exc:
            log.debug("agent %s: connection from %s ended: %s", self.name, who, exc)
        finally:
            self._conns.discard(sock)
            if sock.fileno() >= 0:
                sock.close()

    async def _dispatch(self, conn: Conn, kind: FrameKind, rid: int, meta: dict[str, Any], plen: int) -> None:
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
        if kind not in (FrameKind.PUT, FrameKind.GET):
            raise WireError(f"unexpected {kind.name} request")
        try:
            request = RangeRequest.from_meta(meta)
            if kind == FrameKind.PUT and request.nbytes != plen:
                raise TransportInternalError("request byte count does not match its payload")
        except TransportError as exc:
            await conn.discard(plen)  # keep the stream in step; nothing is written
            await conn.refuse(rid, exc)
            return
        await self.routes.range_request(conn, kind, rid, request, plen)


def hello(name: str, incarnation: str, lane: str) -> dict[str, str]:
    """The HELLO fields that say who connects (``name``, ``incarnation``) and for what (``lane``);
    :meth:`Channel.open` adds the target and the token fields."""
    return {"from": name, "from_incarnation": incarnation, "lane": lane}


def listen_address(listen: str | None, store_url: str) -> tuple[str, int]:
    """Where an agent listens: ``listen`` (``HOST`` or ``HOST:PORT``) if given, else the local
    address that reaches a ``tcp://`` store (any port), else 127.0.0.1."""
    if listen:
        host, _, port = listen.rpartition(":") if ":" in listen else (listen, "", "0")
        return host.strip("[]"), int(port or 0)
    parsed = urllib.parse.urlparse(store_url)
    if parsed.scheme == "tcp" and parsed.hostname:
        return local_address_towards(parsed.hostname, parsed.port or 1), 0
    return "127.0.0.1", 0


def local_address_towards(host: str, port: int) -> str:
    """The local IP this host would use to reach ``host`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"



class ChannelPool:
    """At most one open :class:`Channel` per peer (per incarnation), opened on first use."""

    def __init__(self, tg: TaskGroup, hello: Mapping[str, Any], auth: Authenticator) -> None:
        self._tg = tg
        self._hello = dict(hello)
        self._auth = auth
        self._channels: dict[str, tuple[str, Channel]] = {}
        self._locks: dict[str, anyio.Lock] = {}

    async def get(self, peer: str, incarnation: str, address: tuple[str, int]) -> Channel:
        lock = self._locks.setdefault(peer, anyio.Lock())
        async with lock:
            cached = self._channels.get(peer)
            if cached is not None:
                inc, chan = cached
                if inc == incarnation and not chan.broken:
                    return chan
                chan.close()
            chan = await Channel.open(self._tg, address, peer=peer, peer_incarnation=incarnation, hello=self._hello,
                                      auth=self._auth)
            self._channels[peer] = (incarnation, chan)
            return chan

    def forget_peer(self, peer: str) -> None:
        cached = self._channels.pop(peer, None)
        if cached is not None:
            cached[1].close()

    def close(self) -> None:
        for peer in list(self._channels):
            self.forget_peer(peer)
