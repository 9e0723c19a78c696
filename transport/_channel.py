"""Client connections to other agents: :class:`Channel` (pipelined requests on one
connection), :class:`ChannelPool` (at most one per peer) and :func:`greet_plain` (a HELLO for a
connection that native code takes over: the tcp direct lane). The server side is ``_agent``."""

from __future__ import annotations

import itertools
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._auth import Authenticator
from ._errors import ClosedError, PeerLostError, TransferTimeoutError, TransportError, WireError
from ._sockets import (
    CONNECTION_ENDED,
    abort_socket,
    close_socket,
    connect,
    delivery_progress,
    discard,
    payload_parts,
    read_frame_head,
    recv_into_views,
    send_all_views,
)
from ._wire import PRE_AUTH_META, ErrCode, FrameKind, encode_frame, frame_to_error, kind_name

log = logging.getLogger(__name__)

# How long a released channel (its peer forgotten: it left, or was lost or excluded) keeps reading
# replies already on their way: a request the peer answered just before it closed succeeds.
RELEASE_GRACE_S = 2.0
# A send that fails gives the reply reader this long to read why (a GOING_AWAY notice already in
# the socket means the request was not carried out and may go on a new connection).
_WHY_GRACE_S = 1.0


class _WentAway(PeerLostError):
    """The agent closed the connection to make room, having carried out nothing on it since
    its last reply: a request still unanswered goes again on a new connection. (Should one
    ever escape, it is what it was before the notice existed: a PeerLostError.)"""


class _Reply:
    __slots__ = ("abandoned", "error", "event", "into", "kind", "meta")

    def __init__(self, into: Sequence[memoryview] | None) -> None:
        self.event = anyio.Event()
        self.into = into
        # Its waiter gave up (cancelled, or its deadline passed) after the request went out: a
        # payload that still comes is read and dropped, never written into ``into`` (the
        # caller may reuse that memory, or a bounce buffer went back to its pool).
        self.abandoned = False
        self.kind: int | None = None
        self.meta: dict[str, Any] = {}
        self.error: BaseException | None = None


class Channel:
    """One connection to a peer's agent, with pipelined requests.

    Create with :meth:`open`. A broken channel (EOF, reset, protocol error, or a send that
    overran its deadline) fails every outstanding request with :class:`PeerLostError` and
    refuses new ones; open a new channel to retry. The one exception: an agent that closes the
    connection to make room for others says so first (ErrCode.GOING_AWAY), and a channel made
    by :meth:`open` then sends its unanswered requests again on a new connection, its
    *successor* (which :class:`ChannelPool` adopts), as if nothing had happened.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self.peer = peer
        self._ids = itertools.count(1)
        self._replies: dict[int, _Reply] = {}
        self._send_lock = anyio.Lock()
        self._broken: BaseException | None = None
        self._closed = anyio.Event()
        self._used = time.monotonic()  # last request sent or reply read
        self._idle_limit = math.inf  # the agent closes the connection after this long idle
        self._tg: TaskGroup | None = None  # where the reader runs (and a release's deadline)
        # How to open another connection like this one (set by open()), and the one opened when
        # the agent went away from this one.
        self._reopen: Callable[[], Awaitable[Channel]] | None = None
        self._successor: Channel | None = None
        self._succession = anyio.Lock()

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
        chan = await cls.greet(tg, sock, peer=peer, peer_incarnation=peer_incarnation, hello=hello, auth=auth)

        async def reopen() -> Channel:
            return await cls.open(tg, address, peer=peer, peer_incarnation=peer_incarnation, hello=hello, auth=auth)

        chan._reopen = reopen
        return chan

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
        chan._tg = tg
        meta = _hello_meta(hello, auth, peer, peer_incarnation)
        try:
            tg.start_soon(chan._read_loop)
            reply = await chan.request(FrameKind.HELLO, meta)
            auth.check_ok(reply, meta, peer, peer_incarnation)
        except BaseException:
            chan.close()
            raise
        idle = reply.get("idle_s")
        if isinstance(idle, (int, float)) and not isinstance(idle, bool) and 0 < idle < math.inf:
            chan._idle_limit = float(idle)
        return chan

    @property
    def idle_expired(self) -> bool:
        """Whether this channel sat idle for half the time after which its agent closes idle
        connections: the next request goes on a new one (never into a closing connection)."""
        return not self._replies and time.monotonic() - self._used > self._idle_limit / 2

    @property
    def broken(self) -> bool:
        return self._broken is not None

    @property
    def local_address(self) -> str:
        """The local IP address the connection leaves from ("" once closed)."""
        try:
            return str(self._sock.getsockname()[0])
        except OSError:
            return ""

    @property
    def outstanding(self) -> int:
        """Requests sent (or being sent) whose replies have not arrived."""
        return len(self._replies)

    def progress(self) -> int | None:
        """Bytes the connection has delivered so far, both ways (see
        ``_sockets.delivery_progress``): unchanged over a while with requests outstanding,
        the link is stalled. None where the kernel does not tell."""
        return delivery_progress(self._sock)

    def abort(self, reason: BaseException) -> None:
        """Closes the connection at once, dropping what the kernel has not sent yet (a
        reset), and fails every outstanding request with ``reason`` (see :meth:`close`): for a
        connection given up on (its link stalled), whose queued bytes must not land later."""
        abort_socket(self._sock)
        self.close(reason)

    @property
    def successor(self) -> Channel | None:
        """The open connection that took over from this one after its agent went away, if any."""
        return self._successor

    def detach_successor(self) -> Channel | None:
        """Hands the successor over (to a pool): closing this channel no longer closes it."""
        successor, self._successor = self._successor, None
        return successor

    async def _take_over(self) -> Channel:
        """This channel's successor, opened now if there is none yet (the agent went away).

        Raises:
            PeerLostError, AuthenticationError, TransportError: as :meth:`open`.
        """
        assert self._reopen is not None
        async with self._succession:
            if self._successor is None or self._successor.broken:
                self._successor = await self._reopen()
            return self._successor

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
        close_socket(self._sock)
        if self._successor is not None:  # (not handed over: whoever closes this one owns it)
            self._successor.close(reason)

    def release(self, reason: BaseException, grace: float = RELEASE_GRACE_S) -> None:
        """Takes no new request (they raise ``reason``'s kind) but keeps reading the replies of
        those in flight for up to ``grace`` seconds, then closes; what is still unanswered then
        (or when the peer closes first) fails with ``reason``. A peer that answered and then
        closed its Transport is not reported as having failed the request."""
        if self._successor is not None:
            self._successor.release(reason, grace)
        if self._broken is not None:
            return
        self._broken = reason
        if self._close_if_unwaited():
            return
        if self._tg is None:
            self.close()
            return
        self._tg.start_soon(self._close_after, grace)

    async def _close_after(self, grace: float) -> None:
        with anyio.move_on_after(grace):
            await self._closed.wait()
        self.close()

    def _close_if_unwaited(self) -> bool:
        """Closes a released channel once nobody waits for a reply on it; True if closed."""
        if self._broken is None or not all(r.abandoned for r in self._replies.values()):
            return False
        self.close()
        return True

    def _went_away(self) -> bool:
        """Whether the agent went away from this connection and another may take over."""
        return isinstance(self._broken, _WentAway) and self._reopen is not None

    def _failure(self, what: str) -> TransportError:
        """Why a request cannot go on this broken channel: ClosedError when we closed it."""
        if isinstance(self._broken, ClosedError):
            return ClosedError(str(self._broken))  # a new one per request: tasks raise their own
        return self._lost(what, self._broken)

    def _lost(self, what: str, cause: BaseException | None) -> PeerLostError:
        err = PeerLostError(f"connection to {self.peer} lost: {what}")
        err.__cause__ = cause
        return err

    async def request(
        self,
        kind: int,
        meta: Mapping[str, Any],
        payload: memoryview | Sequence[memoryview] | None = None,
        into: memoryview | Sequence[memoryview] | None = None,
    ) -> dict[str, Any]:
        """Sends one request and waits for its reply; returns the reply's metadata.

        ``payload`` (one view or several, back to back) is sent after the frame; ``into`` (one
        view or several) receives a DATA reply's payload in place.
        Once a frame has started on the wire it is finished (shielded, bounded by the caller's
        deadline): cancelling before that sends nothing; cancelling after it only stops the wait.

        If the agent goes away from this connection before it answers (ErrCode.GOING_AWAY: it
        carried out nothing unanswered), the request goes again on the successor connection.

        Raises:
            PeerLostError: the connection broke (before or during this request).
            TransferTimeoutError: the frame could not be sent by the caller's deadline.
            TransportError subclasses: the agent refused (mapped from the ERR frame).
        """
        if self._broken is not None:
            if self._went_away():
                return await (await self._take_over()).request(kind, meta, payload, into)
            raise self._failure("earlier failure")
        rid = next(self._ids)
        self._used = time.monotonic()
        reply = _Reply(None if into is None else payload_parts(into))
        self._replies[rid] = reply
        parts = payload_parts(payload)
        frame = encode_frame(kind, rid, meta, sum(len(p) for p in parts))
        deadline = anyio.current_effective_deadline()
        unsent: BaseException | None = None
        try:
            async with self._send_lock:
                if self._broken is not None:
                    if not self._went_away():
                        raise self._failure("earlier failure")
                    unsent = self._broken
                else:
                    with anyio.CancelScope(shield=True, deadline=deadline) as scope:
                        try:
                            await send_all_views(self._sock, [memoryview(frame), *parts])
                        except (OSError, anyio.ClosedResourceError) as exc:
                            unsent = exc
                    if unsent is None and scope.cancelled_caught:
                        # A frame cut in half leaves the stream unusable: drop the connection.
                        late = TransferTimeoutError(f"sending to {self.peer} did not finish by the deadline")
                        self.close(self._lost("send timed out", late))
                        raise late
            if unsent is not None:
                if self._broken is None and self._reopen is not None:
                    # The reply reader may be about to read why: a GOING_AWAY notice (then this
                    # request was not carried out and goes again), or the end of the stream.
                    with anyio.move_on_after(_WHY_GRACE_S):
                        await self._closed.wait()
                if self._went_away():
                    self._replies.pop(rid, None)
                    return await (await self._take_over()).request(kind, meta, payload, into)
                # If the reader already saw the connection die (or we closed it), report that.
                if isinstance(self._broken, ClosedError):
                    raise self._failure("closed") from unsent
                cause = self._broken or unsent
                err = self._lost(f"send failed: {cause}", cause)
                self.close(err)
                raise err from cause
        except BaseException:
            if not reply.event.is_set():
                self._replies.pop(rid, None)
            raise
        try:
            await reply.event.wait()
        except BaseException:
            reply.abandoned = True
            self._close_if_unwaited()
            raise
        if reply.error is not None:
            if isinstance(reply.error, _WentAway) and self._reopen is not None:
                return await (await self._take_over()).request(kind, meta, payload, into)
            if isinstance(reply.error, ClosedError):
                raise ClosedError(str(reply.error))
            if isinstance(reply.error, PeerLostError):  # a new one per request: tasks raise their own
                lost = PeerLostError(str(reply.error))
                lost.__cause__ = reply.error.__cause__
                raise lost
            raise self._lost("connection failed", reply.error)
        if reply.kind == FrameKind.ERR:
            raise frame_to_error(reply.meta, self.peer)
        return reply.meta

    async def _read_loop(self) -> None:
        try:
            while True:
                kind, rid, meta, payload_len = await read_frame_head(self._sock)
                if rid == 0:  # no request has id 0: the agent's notice that it closes the connection
                    if kind != FrameKind.ERR or meta.get("code") != ErrCode.GOING_AWAY:
                        raise WireError(f"{kind_name(kind)} frame with request id 0")
                    why = str(meta.get("message", ""))[:300]
                    log.debug("connection to %s: the agent went away (%s); unanswered requests go on a new "
                              "connection", self.peer, why)
                    self.close(_WentAway(f"connection to {self.peer} lost: {why}"))
                    return
                if kind not in (FrameKind.OK, FrameKind.DATA, FrameKind.ERR):  # e.g. a request kind sent back
                    raise WireError(f"a {kind_name(kind)} frame where a reply was due")
                reply = self._replies.pop(rid, None)
                if reply is None:
                    raise WireError(f"reply to unknown request {rid}")
                if kind == FrameKind.DATA and not reply.abandoned:
                    if reply.into is None or sum(len(v) for v in reply.into) != payload_len:
                        raise WireError(f"DATA of {payload_len} bytes does not match the request")
                    await recv_into_views(self._sock, reply.into)
                elif payload_len:
                    await discard(self._sock, payload_len)
                reply.kind, reply.meta = kind, meta
                self._used = time.monotonic()
                reply.event.set()
                if self._close_if_unwaited():
                    return
        except Exception as exc:  # ended, garbled, or a bug of ours: fail this channel, never the task group
            if not isinstance(exc, CONNECTION_ENDED):
                log.warning("connection to %s: reply reader failed", self.peer, exc_info=True)
            self.close(self._lost(str(exc) or type(exc).__name__, exc))
        except anyio.get_cancelled_exc_class():
            self.close(ClosedError(f"connection to {self.peer} closed"))
            raise


def _hello_meta(hello: Mapping[str, Any], auth: Authenticator, peer: str, peer_incarnation: str) -> dict[str, Any]:
    meta = {**hello, "to": peer, "to_incarnation": peer_incarnation}
    meta.update(auth.hello_fields(meta["from"], meta["from_incarnation"], peer, peer_incarnation))
    return meta


async def greet_plain(sock: socket.socket, *, peer: str, peer_incarnation: str, hello: Mapping[str, Any],
                      auth: Authenticator) -> None:
    """Says HELLO on a connected ``sock`` and reads the answer, with no reader task: for a
    connection that native code takes over afterwards (the ``tcp`` direct lane). The caller
    owns the socket and bounds the wait.

    Raises:
        PeerLostError: the connection broke, or another incarnation answered.
        AuthenticationError: either side lacks the shared token.
        TransportError: any other refusal.
    """
    meta = _hello_meta(hello, auth, peer, peer_incarnation)
    try:
        await send_all_views(sock, [memoryview(encode_frame(FrameKind.HELLO, 1, meta, 0))])
        kind, rid, reply, plen = await read_frame_head(sock, PRE_AUTH_META)
    except CONNECTION_ENDED as exc:
        raise PeerLostError(f"connection to {peer} lost during its HELLO: {exc}") from exc
    if rid != 1 or plen or kind not in (FrameKind.OK, FrameKind.ERR):
        raise PeerLostError(f"{peer} answered the HELLO with {kind_name(kind)} (request {rid}, {plen} payload bytes)")
    if kind == FrameKind.ERR:
        raise frame_to_error(reply, peer)
    auth.check_ok(reply, meta, peer, peer_incarnation)


def hello(name: str, incarnation: str, lane: str) -> dict[str, str]:
    """The HELLO fields that say who connects (``name``, ``incarnation``) and for what (``lane``);
    :meth:`Channel.open` adds the target and the token fields."""
    return {"from": name, "from_incarnation": incarnation, "lane": lane}


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
                while inc == incarnation and chan.broken and (heir := chan.detach_successor()) is not None:
                    chan.close()  # the agent went away from it: its successor took over
                    chan = heir
                    self._channels[peer] = (inc, chan)
                if inc == incarnation and not chan.broken and not chan.idle_expired:
                    return chan
                chan.close()
            chan = await Channel.open(self._tg, address, peer=peer, peer_incarnation=incarnation, hello=self._hello,
                                      auth=self._auth)
            self._channels[peer] = (incarnation, chan)
            return chan

    def forget_peer(self, peer: str) -> None:
        """Drops the channel to ``peer`` (it left, or was lost or excluded): requests in flight
        on it still get replies already on their way (see :meth:`Channel.release`)."""
        cached = self._channels.pop(peer, None)
        if cached is not None:
            cached[1].release(PeerLostError(f"connection to {peer} released: {peer} is gone"))

    def close(self) -> None:
        for _, chan in self._channels.values():
            chan.close()
        self._channels.clear()
