"""Striping over NICs: a large ``tcp`` transfer to a peer whose agent listens on several
addresses (one per NIC, ``PeerRecord.addresses``) is cut into chunks and spread over one *lane*
per address, each lane its own agent connection.

* **Pairing.** A lane connects to one of the peer's addresses and leaves by the local address
  the kernel routes it from: where each NIC is on a subnet of its own (NIC ``i`` of one host
  reaches NIC ``i`` of another), lane ``i`` pairs local NIC ``i`` with the peer's NIC ``i``. An
  address that cannot be reached (no route, refused, no answer within ``LANE_CONNECT_S``) gives
  no lane for ``LANE_RETRY_S``.
* **Proportion.** Every lane keeps ``LANE_DEPTH`` chunks in flight and takes the next one as
  soon as one is delivered, so each lane carries what it delivers: a lane twice as fast carries
  twice the bytes. Each lane's rate (an EWMA of its bytes/s) decides the end: a lane leaves the
  last chunks to the others when they would deliver all that is left before it delivered one.
* **Failure.** A lane whose connection breaks, or that delivers nothing for ``stall_s`` seconds
  (``TCP_INFO``: no byte acknowledged or received) while another lane still delivers, is given
  up: its connection is reset (where puts are on the wire on it, once they settled: see below),
  its chunks go to the other lanes, and it is not tried again for ``LANE_RETRY_S``. When every
  lane broke, the transfer fails with :class:`PeerLostError`; when every lane stalls at once
  (the peer itself stopped), none is given up and the transfer ends at its deadline, as on one
  connection.
* **Abandoned chunks.** A put's chunk whose reply is no longer waited for (the transfer was
  cancelled or ran out of time, or its lane broke or was given up) may still land: its bytes
  are in the sockets' buffers, and the target writes what reaches it. So the connection that
  carried it is ended and *settled*: Stripes holds a descriptor of every lane connection of its
  own, so the connection outlives its :class:`Channel` (closed, reset, or cut mid-frame by a
  deadline), and hands it, with the ranges of the puts still on the wire on it, to ``abandon``
  (the backend's: those ranges stay unsettled, and transfers that overlap them wait, until the
  target has ended that connection, at most the timeout). The lane goes on with a new one.
  (Lane connections are greeted by Stripes itself, so they have no successor: one whose agent
  went away from it, to make room, is replaced at its next use, or given up if a chunk was on
  its way then.)
* **Records.** Each chunk delivered is noted on the transfer's flight record (its ``lanes``:
  lane -> bytes), and in the lane's counters (:meth:`Stripes.stats`).

Small transfers never come here (``STRIPE_MIN_BYTES``): they keep the one connection (or the
direct lane) and its latency.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

from ..._auth import Authenticator
from ..._channel import Channel
from ..._errors import ClosedError, PeerLostError, TransferTimeoutError, TransportError
from ..._flight import carried_by
from ..._sockets import connect
from ..._wire import PeerRecord

log = logging.getLogger(__name__)

STRIPE_MIN_BYTES = 8 << 20  # a transfer (or prepared start) smaller than this stays on one connection
STRIPE_CHUNK = 4 << 20  # bytes per chunk (a multiple of every element size)
LANE_DEPTH = 2  # chunks in flight per lane: the next is on the wire while the last one's reply comes back
LANE_STALL_S = 3.0  # a lane that delivers nothing this long, while another does, is given up
LANE_RETRY_S = 30.0  # a lane given up (or that could not connect) is not tried again for this long
LANE_CONNECT_S = 5.0  # connecting a lane and its HELLO, at most
_WATCH_EVERY_S = 0.25
_RATE_WEIGHT = 0.3  # the EWMA's weight of the newest chunk

_C = TypeVar("_C")

Range = tuple[str, int, int]  # (region key, byte offset, nbytes) at the target
# The backend's hook for a connection ended with puts still on the wire on it: their ranges,
# and our own descriptor of the connection (now the hook's), to settle (TcpBackend._abandon).
Abandon = Callable[[str, Sequence[Range], socket.socket], None]


@dataclasses.dataclass(eq=False)
class Lane:
    """One connection to one of a peer's addresses, and what it delivered."""

    remote: tuple[str, int]
    chan: Channel | None = None
    local: str = ""  # the local address it leaves from (once connected)
    failed_at: float = -math.inf  # when it was last given up (or failed to connect)
    why: str = ""
    delivered: int = 0  # bytes, over every transfer
    chunks: int = 0
    failures: int = 0
    rate: float = 0.0  # bytes/s, an EWMA over its chunks
    pending: int = 0  # bytes of its chunks on the wire now
    last_done: float = 0.0  # when its last chunk was delivered
    seen: int | None = None  # its connection's delivery counter at the last look
    seen_at: float = 0.0  # when that counter last moved (or the lane had nothing outstanding)
    connecting: anyio.Event | None = None  # set once the connection being opened is open or failed

    @property
    def label(self) -> str:
        """``local>host:port``, as flight records name it."""
        return f"{self.local or '?'}>{self.remote[0]}:{self.remote[1]}"

    def usable(self, now: float) -> bool:
        return now - self.failed_at > LANE_RETRY_S

    def as_dict(self) -> dict[str, Any]:
        return {"lane": self.label, "bytes": self.delivered, "chunks": self.chunks, "failures": self.failures,
                "rate_bytes_s": round(self.rate), "up": self.failed_at == -math.inf or self.usable(time.monotonic()),
                "why": self.why}


@dataclasses.dataclass(eq=False)
class _Held:
    """A lane connection as Stripes holds it besides its Channel: a descriptor of its socket of
    its own (the connection lasts until this one is closed, or settled by ``abandon``), and the
    puts on the wire on it (each one's ranges, worked out only if it is abandoned)."""

    sock: socket.socket
    writing: dict[object, Callable[[], Sequence[Range]]] = dataclasses.field(default_factory=dict)


def _answered(exc: BaseException) -> bool:
    """Whether a request that raised ``exc`` got its reply (a refusal: nothing was written),
    rather than being given up on while its bytes may still be on their way."""
    return isinstance(exc, TransportError) and not isinstance(exc, (PeerLostError, ClosedError,
                                                                    TransferTimeoutError))


class _Run(Generic[_C]):
    """The chunks of one striped transfer: those waiting, and how many are on the wire."""

    def __init__(self, chunks: Sequence[_C], size: Callable[[_C], int], lanes: Sequence[Lane]) -> None:
        self.todo: collections.deque[_C] = collections.deque(chunks)
        self.size = size
        self.lanes = lanes
        self.todo_bytes = sum(size(c) for c in chunks)
        self.inflight = 0
        self.error: TransportError | None = None
        self.lost: list[str] = []  # why lanes of this run were given up
        self.started = time.monotonic()
        self.connecting: set[anyio.CancelScope] = set()  # senders waiting for their lane to connect
        self._changed = anyio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_change(self) -> None:
        await self._changed.wait()

    @property
    def finished(self) -> bool:
        """Nothing waits and nothing is on the wire (or a refusal ended it)."""
        return (not self.todo and not self.inflight) or self.error is not None

    def end(self) -> None:
        """The run is over: senders still waiting for their lane to connect stop waiting."""
        for scope in self.connecting:
            scope.cancel()


class Stripes:
    """The lanes of one ``tcp`` backend to every peer that advertises several addresses.

    Args:
        tg: where lane connections' reply readers run.
        hello: the HELLO fields of a data connection (``_channel.hello``).
        auth: this endpoint's authenticator.
        timeout: the Transport's default timeout (the stall limit is at most a quarter of it).
        abandon: called with a peer's name, the ranges of the puts still on the wire on a lane
            connection that was ended, and our own descriptor of that connection (the callee's
            from then on: it settles and closes it). See "Abandoned chunks" above.
    """

    def __init__(self, tg: TaskGroup, hello: Mapping[str, Any], auth: Authenticator, timeout: float,
                 abandon: Abandon) -> None:
        self._tg = tg
        self._hello = dict(hello)
        self._auth = auth
        self._abandon = abandon
        self.stall_s = min(LANE_STALL_S, timeout / 4)
        self._peers: dict[str, tuple[str, tuple[tuple[str, int], ...], list[Lane]]] = {}
        self._held: dict[Channel, _Held] = {}  # every lane connection open (or not yet let go of)

    @staticmethod
    def applies(peer: PeerRecord, nbytes: int) -> bool:
        """Whether a transfer of ``nbytes`` to ``peer`` is striped."""
        return nbytes >= STRIPE_MIN_BYTES and len(peer.addresses) > 1

    def lanes(self, peer: PeerRecord) -> list[Lane]:
        """The lanes to ``peer``'s incarnation, one per address it advertises."""
        cached = self._peers.get(peer.name)
        if cached is None or cached[0] != peer.incarnation or cached[1] != peer.addresses:
            self.forget_peer(peer.name)
            cached = self._peers[peer.name] = (peer.incarnation, peer.addresses, [Lane(a) for a in peer.addresses])
        return cached[2]

    def stats(self, peer: str) -> list[dict[str, Any]]:
        """Each lane to ``peer``: ``lane``, ``bytes``, ``chunks``, ``failures``, ``rate_bytes_s``,
        ``up`` and ``why`` (its last failure)."""
        cached = self._peers.get(peer)
        return [lane.as_dict() for lane in cached[2]] if cached is not None else []

    async def run(self, peer: PeerRecord, chunks: Sequence[_C], size: Callable[[_C], int],
                  send: Callable[[Channel, _C], Awaitable[None]],
                  writes: Callable[[_C], Sequence[Range]] | None = None) -> None:
        """Moves every chunk with ``send(channel, chunk)`` over the lanes to ``peer`` (those not
        given up in the last ``LANE_RETRY_S``; every one when none is left), each lane taking
        the next chunk as it delivers one. A chunk whose lane broke or stalled is sent again
        on another (``send`` must be repeatable: it writes the same bytes to the same place).
        ``writes(chunk)``: the target's ranges a chunk writes (puts; None for gets), which stay
        unsettled where it is abandoned (see "Abandoned chunks" above).

        Raises:
            PeerLostError: every lane broke (the message says how each did); the chunks that
                were delivered stay delivered.
            TransportError: what ``send`` raised other than a broken lane (a refusal); the
                chunks on the wire then are waited for, no new one is sent.

        Cancellation (or the caller's deadline): the chunks on the wire are left as
        ``Channel.request`` leaves a cancelled request (a frame started is finished, its reply
        no longer waited for); none is started after. Where they are puts, their connections
        are ended and handed to ``abandon`` (their ranges unsettled until the target has ended
        them); the lanes open new ones for the next transfer.
        """
        lanes = self.lanes(peer)
        now = time.monotonic()
        run: _Run[_C] = _Run(chunks, size, [lane for lane in lanes if lane.usable(now)] or lanes)
        usable = run.lanes
        async with anyio.create_task_group() as watching:
            watching.start_soon(self._watch, peer.name, usable, run)
            async with anyio.create_task_group() as senders:
                for lane in usable:
                    for _ in range(LANE_DEPTH):
                        senders.start_soon(self._work, peer, lane, run, size, send, writes)
            watching.cancel_scope.cancel()
        if run.error is not None:
            raise run.error
        if run.todo:
            raise PeerLostError(f"every lane to {peer.name} failed with {len(run.todo)} of {len(chunks)} chunks "
                                f"left: {'; '.join(run.lost) or 'no lane could connect'}")

    async def _work(self, peer: PeerRecord, lane: Lane, run: _Run[_C], size: Callable[[_C], int],
                    send: Callable[[Channel, _C], Awaitable[None]],
                    writes: Callable[[_C], Sequence[Range]] | None) -> None:
        """One of ``lane``'s ``LANE_DEPTH`` senders: takes chunks until none is left (or the
        lane fails: its chunk goes back for the others). A chunk given up on while on the wire
        (cancelled, out of time, the connection lost) ends its connection (:meth:`_end`); where
        another transfer's put ended it, the lane goes on with a new one."""
        try:
            chan = await self._open(peer, lane, run)
            while chan is not None and run.error is None:
                if chan.broken:
                    if lane.chan is chan:
                        return  # (the lane broke or was given up: its senders report it)
                    chan = await self._open(peer, lane, run)  # (it was ended under us)
                    continue
                if not run.todo:
                    if not run.inflight:
                        run.end()
                        return
                    await run.wait_change()
                    continue
                n = size(run.todo[0])
                if not self._worth_taking(lane, run, n):
                    await run.wait_change()
                    continue
                chunk = run.todo.popleft()
                run.todo_bytes -= n
                run.inflight += 1
                lane.pending += n
                held, token = self._held.get(chan), object()
                if held is not None and writes is not None:
                    held.writing[token] = functools.partial(writes, chunk)
                started = time.monotonic()
                try:
                    await send(chan, chunk)
                except PeerLostError as exc:  # the lane broke, or was given up: another one sends it
                    run.todo.appendleft(chunk)
                    run.todo_bytes += n
                    if lane.chan is chan:
                        self._fail(peer.name, lane, f"{lane.label}: {exc}", run)
                        return
                    self._end(peer.name, chan, exc)  # (ended by another transfer: a new connection)
                    continue
                except TransportError as exc:  # refused (or past the deadline): the transfer's error
                    if not _answered(exc):
                        self._retire(peer.name, lane, chan)
                    if run.error is None:
                        run.error = exc
                    run.end()
                    return
                except BaseException:  # cancelled: its reply is no longer waited for
                    if writes is not None:
                        self._retire(peer.name, lane, chan)
                    raise
                finally:
                    if held is not None:
                        held.writing.pop(token, None)
                    lane.pending -= n
                    run.inflight -= 1
                    run.changed()
                self._delivered(lane, n, started)
        finally:
            run.changed()

    @staticmethod
    def _worth_taking(lane: Lane, run: _Run[Any], nbytes: int) -> bool:
        """Whether ``lane`` should take the next chunk (``nbytes``): yes unless the run's other
        live lanes, at their measured rates, would deliver everything left (their chunks on the
        wire, and every waiting chunk, this one included) before ``lane`` delivered this one
        after its own chunks on the wire. So a slow lane carries its share while much is left,
        and leaves the last chunks to the faster ones instead of finishing the transfer late.
        It is asked again at every change (a chunk delivered, a lane given up); with nothing of
        the run on the wire (no change to wait for) the answer is yes."""
        if not lane.rate or not run.inflight:
            return True
        others = [other for other in run.lanes if other is not lane and other.rate and other.chan is not None
                  and not other.chan.broken]
        rate = sum(other.rate for other in others)
        if not rate:
            return True
        return (lane.pending + nbytes) / lane.rate <= (sum(other.pending for other in others) + run.todo_bytes) / rate

    def _delivered(self, lane: Lane, nbytes: int, started: float) -> None:
        now = time.monotonic()
        took = now - max(started, lane.last_done)  # (its chunks overlap: count each second once)
        lane.last_done = now
        if took > 0:
            rate = nbytes / took
            lane.rate = rate if not lane.rate else (1 - _RATE_WEIGHT) * lane.rate + _RATE_WEIGHT * rate
        lane.delivered += nbytes
        lane.chunks += 1
        carried_by(lane.label, nbytes)

    async def _open(self, peer: PeerRecord, lane: Lane, run: _Run[Any]) -> Channel | None:
        """``lane``'s connection, opened now if it has none that works; None when it cannot
        connect (it is then not tried again for ``LANE_RETRY_S``), or when the run ended (the
        other lanes delivered everything) while it was connecting: the connection is made in
        the background (:meth:`_connect`), so a lane slow to connect never delays a transfer
        the others carry."""
        chan = lane.chan
        if chan is not None and not chan.broken and not chan.idle_expired:
            return chan
        if lane.failed_at >= run.started:
            return None  # (it failed during this run)
        if lane.connecting is None:
            if chan is not None:
                lane.chan = None
                self._end(peer.name, chan, PeerLostError(f"lane {lane.label} to {peer.name}: replaced"))
            lane.connecting = anyio.Event()
            self._tg.start_soon(self._connect, peer, lane, lane.connecting)
        connected = lane.connecting
        if run.finished:
            return None
        with anyio.CancelScope() as waiting:
            run.connecting.add(waiting)
            try:
                await connected.wait()
            finally:
                run.connecting.discard(waiting)
        if waiting.cancelled_caught or lane.chan is None:
            if lane.chan is None and lane.why and f"{lane.remote[0]}:{lane.remote[1]}: {lane.why}" not in run.lost:
                run.lost.append(f"{lane.remote[0]}:{lane.remote[1]}: {lane.why}")
            return None
        return lane.chan

    async def _connect(self, peer: PeerRecord, lane: Lane, connected: anyio.Event) -> None:
        """Opens ``lane``'s connection (at most ``LANE_CONNECT_S``), or records why it could not."""
        try:
            with anyio.fail_after(LANE_CONNECT_S):
                chan = await self._dial(peer, lane.remote)
        except (TransportError, TimeoutError, OSError) as exc:
            why = str(exc) or type(exc).__name__  # (a deadline's TimeoutError has no message)
            lane.failed_at, lane.why = time.monotonic(), f"{why} (connect)"
            lane.failures += 1
            log.info("tcp: no lane to %s at %s:%d (%s); not tried again for %gs", peer.name, *lane.remote, why,
                     LANE_RETRY_S)
        else:
            if lane.failed_at > -math.inf:
                log.info("tcp: lane %s>%s:%d to %s is back", chan.local_address, *lane.remote, peer.name)
            lane.chan, lane.local = chan, chan.local_address
            lane.seen, lane.seen_at = None, time.monotonic()
            lane.failed_at, lane.why = -math.inf, ""
        finally:
            lane.connecting = None
            connected.set()

    async def _dial(self, peer: PeerRecord, address: tuple[str, int]) -> Channel:
        """A connection to ``address``, greeted, and held (:class:`_Held`) until it is let go
        of (:meth:`_end`, which :meth:`_reap` calls once its channel ended, at the latest).

        Raises:
            PeerLostError, AuthenticationError, TransportError: as ``Channel.open``.
            OSError: no second descriptor could be made.
        """
        try:
            sock = await connect(address)
        except OSError as exc:
            raise PeerLostError(f"cannot reach the agent of {peer.name} at {address[0]}:{address[1]}: {exc}") from exc
        try:
            hold = sock.dup()
        except OSError:
            sock.close()
            raise
        try:
            chan = await Channel.greet(self._tg, sock, peer=peer.name, peer_incarnation=peer.incarnation,
                                       hello=self._hello, auth=self._auth)
        except BaseException:
            hold.close()
            raise
        self._held[chan] = _Held(hold)
        self._tg.start_soon(self._reap, peer.name, chan)
        return chan

    async def _reap(self, peer: str, chan: Channel) -> None:
        """Lets go of ``chan``'s connection once the channel ended, however it ended."""
        why = await chan.wait_closed()
        self._end(peer, chan, why)

    def _retire(self, peer: str, lane: Lane, chan: Channel) -> None:
        """Ends ``chan``, on which a put was given up on, without giving ``lane`` up: its other
        senders go on with a new connection."""
        if lane.chan is chan:
            lane.chan = None
        self._end(peer, chan, PeerLostError(f"lane {lane.label} to {peer}: a put on it was given up on; the lane "
                                            "goes on with a new connection"))

    def _end(self, peer: str, chan: Channel, reason: BaseException, *, reset: bool = False) -> None:
        """Ends ``chan`` and lets go of our descriptor of its connection: handed to ``abandon``
        with the ranges of the puts still on the wire on it, which may still land; else closed.
        ``reset``: the connection is reset once let go of (what it has not sent is dropped).
        Idempotent."""
        held = self._held.pop(chan, None)
        if reset:
            chan.abort(reason)
        else:
            chan.close(reason)
        if held is None:
            return
        ranges = [r for ranges_of in held.writing.values() for r in ranges_of()]
        held.writing.clear()
        if ranges:
            self._abandon(peer, ranges, held.sock)
        else:
            held.sock.close()

    def _fail(self, peer: str, lane: Lane, why: str, run: _Run[Any] | None = None) -> None:
        """Gives ``lane`` up: its connection is reset (where puts are on the wire on it, once
        they settled: :meth:`_end`), and it is not tried again for ``LANE_RETRY_S``."""
        if run is not None and why not in run.lost:
            run.lost.append(why)
        if lane.chan is None or (lane.chan.broken and lane.failed_at > -math.inf):
            return  # (already given up: its other senders report the same)
        lane.failed_at, lane.why = time.monotonic(), why
        lane.failures += 1
        log.warning("tcp: lane %s to %s failed (%s); its chunks go to the other lanes, and it is tried again in "
                    "%gs", lane.label, peer, why, LANE_RETRY_S)
        self._end(peer, lane.chan, PeerLostError(f"lane {lane.label} to {peer} given up: {why}"), reset=True)

    async def _watch(self, peer: str, lanes: Sequence[Lane], run: _Run[Any]) -> None:
        """Gives up a lane that delivered nothing for ``stall_s`` while it had chunks on the
        wire and another lane did not stall (a cut link), never every lane at once (a stopped
        peer: the deadline decides)."""
        while True:
            await anyio.sleep(_WATCH_EVERY_S)
            now = time.monotonic()
            stalled, fine = [], 0
            for lane in lanes:
                chan = lane.chan
                if chan is None or chan.broken:
                    continue
                seen = chan.progress()
                if not chan.outstanding or seen is None or seen != lane.seen:
                    lane.seen, lane.seen_at = seen, now
                if now - lane.seen_at > self.stall_s:
                    stalled.append(lane)
                else:
                    fine += 1
            if fine:
                for lane in stalled:
                    self._fail(peer, lane, f"{lane.label}: delivered nothing for {now - lane.seen_at:.1f}s", run)

    def forget_peer(self, peer: str) -> None:
        """Drops the lanes to ``peer`` (it left, restarted or was lost): replies already on
        their way are still read (``Channel.release``)."""
        cached = self._peers.pop(peer, None)
        for lane in cached[2] if cached is not None else ():
            if lane.chan is not None:
                held = self._held.pop(lane.chan, None)
                if held is not None:  # (what it still carries goes to an incarnation that is gone)
                    held.sock.close()
                lane.chan.release(PeerLostError(f"lane {lane.label} released: {peer} is gone"))

    def close(self) -> None:
        for held in self._held.values():
            held.sock.close()
        self._held.clear()
        for _, _, lanes in self._peers.values():
            for lane in lanes:
                if lane.chan is not None:
                    lane.chan.close()
        self._peers.clear()
