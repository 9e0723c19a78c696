"""``tcp``: any hosts, no extra dependencies.

Bytes travel over one connection per peer to the peer's agent, which checks key, dtype, bounds
and writability and then receives them straight into the registered region (``recv_into``, no
intermediate copy). Not one-sided at the process level: the target's agent, inside its
``async with Transport``, serves the request, but the target's application code does nothing.

Single-range transfers up to ``DIRECT_MAX_BYTES`` take a **direct lane** instead: another
connection to the peer (up to ``DIRECT_LANES_PER_PEER``, opened as needed), authenticated by the
same HELLO, whose both ends are native code
(``transport._native.tcp``). The target serves it on a native thread, checking every request
against a native mirror of its region table, so no Python runs on either side of the wire; the
initiator drives the request inside ``put()`` for up to ``DIRECT_WAIT_S`` (``Backend.mover``),
then, if it is not done, from the event loop like any transfer (sending what the socket takes
whenever it is writable, then reading the reply): a slow or stalled peer never blocks the loop.
Anything the lane cannot do (too big, lane not open yet or busy, a refusal, a broken
connection) takes the checked path above, which reports the precise error.

Transfers of ``STRIPE_MIN_BYTES`` or more to a peer whose agent listens on several addresses
(one per NIC) take no single connection: their chunks (PUT / GET frames, or a prepared start's
run frames) are spread over one lane per address (:mod:`._stripe`).

A put given up on (cancelled, out of time, its connection lost) while a direct lane or a
striping lane carried it may still land after a later transfer: its range stays *unsettled*
until the target has ended that connection, and transfers that overlap it wait
(:meth:`TcpBackend._abandon`).

Both sides are this backend's, behind the backend interface's target-side hook: :class:`TcpBackend`
is the initiator, and on the target its :meth:`~TcpBackend.serve_frame` serves the PUT / GET /
PUTR / GETR frames the agent hands it (their serving: :mod:`._tcp_serve`), its :meth:`~TcpBackend.adopt_lane` takes
the direct lane's connections, and it keeps the native mirror of the region table the direct
lane's threads check against (``region_added`` / ``region_removed`` / ``region_moved``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
import numpy as np

from ... import _pieces
from ..._agent import Conn
from ..._channel import ChannelPool, greet_plain, hello
from ..._errors import TransportError, TransportInternalError, WireError
from ..._native import Copier, CopyKind, CopyStatus
from ..._native.tcp import MAX_DTYPE_BYTES, MAX_KEY_BYTES, DirectLane, DirectServer, LaneResult, RegionMirror
from ..._pieces import Ready
from ..._regions import Region
from ..._sockets import abort_socket, close_socket, connect
from ..._tensors import MemoryKind, Runs, dtype_name, spans_of
from ..._wire import PeerRecord, RegionRecord, TransferOp
from .._base import Backend, BackendContext, LocalBuffer, Mover, Pending, RemoteTarget, Runner
from ._frames import MAX_STAGED_BYTES, RangeRequest, RunsRequest, TcpFrame
from ._run_frames import RunsFrame, build_frames
from ._serve import serve_range, serve_runs
from ._stripe import STRIPE_CHUNK, Range, Stripes

log = logging.getLogger(__name__)

DIRECT_LANE = "direct"  # the HELLO lane of a direct-lane connection (Backend.lanes: the agent hands it to us)

_STAGE_BUFFERS = 4  # staging buffers of MAX_STAGED_BYTES a Transport keeps for reuse
_STAGE_PER_PEER = 2  # staged frames to one peer that hold a buffer at once (see _Stages)
_STAGE_MAX = 64  # staging buffers a Transport lends at once, all peers together (256 MiB)
# Single-range transfers up to this size take the direct lane: native on both ends, about 3-4x
# the checked path's rate at 1-4 MiB (benchmarks/results/ has the figures). Larger ones take the
# checked path, which pipelines frames over the connection.
DIRECT_MAX_BYTES = 16 << 20
DIRECT_WAIT_S = 0.002  # put() waits this long for the direct lane's reply, then the rest goes async
DIRECT_RETRY_S = 1.0  # after a direct lane failed to open, try again no sooner than this
DIRECT_MAX_CONNS = 256  # direct-lane connections one endpoint serves at once (one thread each)
# Direct lanes to one peer: a request whose reply is late holds its lane, and the next transfers
# take another rather than the checked path (more are opened, one at a time, as they are needed).
DIRECT_LANES_PER_PEER = 4


class TcpBackend(Backend):
    name = "tcp"
    one_sided = False
    memory_kinds = frozenset({MemoryKind.CPU})
    frames = frozenset({TcpFrame.PUT, TcpFrame.GET, TcpFrame.PUTR, TcpFrame.GETR})
    lanes = frozenset({DIRECT_LANE})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._pool = ChannelPool(ctx.tg, hello(ctx.name, ctx.incarnation, "tcp"), ctx.auth)
        # Large transfers to a peer that listens on several addresses: one lane per address.
        self._stripes = Stripes(ctx.tg, hello(ctx.name, ctx.incarnation, "tcp"), ctx.auth, ctx.timeout,
                                self._abandon)
        self._lanes: dict[str, tuple[str, list[DirectLane]]] = {}  # peer -> (its incarnation, direct lanes)
        self._opening: dict[str, object] = {}  # peer -> the attempt opening a lane to it now
        self._failed: dict[str, float] = {}  # peer -> when opening its direct lane last failed
        self._stages = _Stages(ctx.copier)  # staging buffers for small runs, shared by every transfer
        # The target side: the host regions as the direct lane's native threads see them. A
        # region withdrawn while a request still moves its bytes stays referenced in _retired
        # (its memory alive) until the mirror releases its token.
        self._mirror = RegionMirror()
        self._retired: dict[int, Region] = {}
        self._tokens = itertools.count(1)
        self._direct: DirectServer | None = None  # made on the first direct-lane connection
        # Puts given up on (cancelled, timed out, their lane lost) while a direct lane or a
        # striping lane carried them: their bytes may still land until the target has ended
        # that connection. Overlapping transfers to the region wait for that (see _abandon).
        self._unsettled: dict[tuple[str, str], list[_Unsettled]] = {}
        self._settling: set[DirectLane] = set()  # their lanes, closed once settled

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        if region.device != "cpu":
            return f"{region.key!r} is device memory ({region.device}); the agent's byte stream writes host memory only"
        return None

    @staticmethod
    def _request(local: LocalBuffer, remote: RemoteTarget) -> RangeRequest:
        return RangeRequest(remote.region.key, dtype_name(local.tensor.dtype), remote.offset, remote.nbytes)

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        await self._after_unsettled(remote.peer.name, remote.region.key, remote.offset, remote.nbytes)
        if await self._by_lane(True, local, remote):
            return
        if Stripes.applies(remote.peer, remote.nbytes):
            await self._striped(True, local, remote)
            return
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        await chan.request(TcpFrame.PUT, self._request(local, remote).to_meta(), payload=local.view)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        await self._after_unsettled(remote.peer.name, remote.region.key, remote.offset, remote.nbytes)
        if await self._by_lane(False, local, remote):
            return
        if Stripes.applies(remote.peer, remote.nbytes):
            await self._striped(False, local, remote)
            return
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        await chan.request(TcpFrame.GET, self._request(local, remote).to_meta(), into=local.view)

    async def _striped(self, put: bool, local: LocalBuffer, remote: RemoteTarget) -> None:
        """One range cut into chunks of ``STRIPE_CHUNK`` bytes (PUT / GET frames of their own),
        spread over the lanes to the peer's addresses (:class:`Stripes`)."""
        key, dtype, view = remote.region.key, dtype_name(local.tensor.dtype), local.view

        async def send(chan: Any, piece: tuple[int, int]) -> None:
            pos, size = piece
            meta = RangeRequest(key, dtype, remote.offset + pos, size).to_meta()
            if put:
                await chan.request(TcpFrame.PUT, meta, payload=view[pos : pos + size])
            else:
                await chan.request(TcpFrame.GET, meta, into=view[pos : pos + size])

        def writes(piece: tuple[int, int]) -> Sequence[Range]:
            return ((key, remote.offset + piece[0], piece[1]),)

        await self._stripes.run(remote.peer, _pieces.cut(remote.nbytes, STRIPE_CHUNK), lambda p: p[1], send,
                                writes if put else None)

    def lane_stats(self, peer: str) -> list[dict[str, Any]]:
        """The striping lanes to ``peer`` and what each delivered (see ``Stripes.stats``); empty
        when nothing was striped to it."""
        return self._stripes.stats(peer)

    async def _by_lane(self, put: bool, local: LocalBuffer, remote: RemoteTarget) -> bool:
        """Moves one range by the direct lane when it can take it (size, key, lane open and
        free): True once the bytes are in place; False when it did not, or was refused or broke
        (nothing written, or the checked path rewrites it all and reports the error)."""
        key, dtype = remote.region.key, dtype_name(local.tensor.dtype)
        if (not 0 < remote.nbytes <= DIRECT_MAX_BYTES or remote.region.device != "cpu"
                or len(key.encode()) > MAX_KEY_BYTES or len(dtype.encode()) > MAX_DTYPE_BYTES):
            return False
        lane = self._lane(remote.peer, open_one=False)  # (put()'s synchronous path opens them)
        if lane is None or lane.pending:
            return False
        result = lane.start(put, key, dtype, remote.offset, remote.nbytes, local.address, 0.0)
        if result is LaneResult.PENDING:
            return await self._finish(remote.peer.name, lane, (key, remote.offset, remote.nbytes) if put else None)
        self._broke_unused(remote.peer.name, lane)
        return result is LaneResult.DONE

    def prepare_runs(self, op: TransferOp, peer: PeerRecord, lists: Sequence[tuple[Runs, RegionRecord]]) -> Runner:
        """The arrays go as PUTR / GETR frames, each led by its binary run table (made once,
        here, from the array's columns), pipelined on the peer's connection. A frame carries
        runs of several regions (its groups), and the agent checks every group before it takes
        a byte: a start whose runs fit one frame lands whole or not at all.

        Runs up to ``STAGE_RUN_MAX`` travel *staged*: a frame's runs (up to MAX_STAGED_BYTES)
        are packed back to back by one native copy job and sent as one buffer, and the agent
        places them by one job too, so a small run costs no Python and no system-call buffer
        on either side. Larger runs go as they are, one view each, received in place."""
        kind = TcpFrame.PUTR if op == TransferOp.PUT else TcpFrame.GETR
        build = functools.partial(build_frames, lists)
        frames = build(None)
        striped: list[list[RunsFrame]] = []  # built on the first striped start
        total = sum(int(r.array[:, 2].sum()) for r, _ in lists)
        stages = self._stages
        put = op == TransferOp.PUT

        async def frame(chan: Any, f: RunsFrame) -> None:
            if f.copies is None:
                if put:
                    await chan.request(kind, f.meta, payload=[f.table, *f.views])
                else:
                    await chan.request(kind, f.meta, payload=f.table, into=f.views)
                return
            async with stages.buffer(peer.name) as (buf, address):
                data = buf[: f.nbytes]
                if put:
                    await stages.copy(f.copies, address, to_stage=True, nbytes=f.nbytes)
                    await chan.request(kind, f.meta, payload=[f.table, data])
                else:
                    await chan.request(kind, f.meta, payload=f.table, into=data)
                    await stages.copy(f.copies, address, to_stage=False, nbytes=f.nbytes)

        spans = spans_of((r.key, r.span[0], r.span[1] - r.span[0]) for r, _ in lists)
        # What a striped frame given up on may still write: the spans of the whole transfer
        # (a frame's runs lie inside them), worked out only then.
        ranges = [(key, lo, hi - lo) for key, (lo, hi) in spans.items()]

        async def run(ready: Ready) -> None:
            for key, lo, nbytes in ranges:
                await self._after_unsettled(peer.name, key, lo, nbytes)
            if Stripes.applies(peer, total):  # the frames spread over the lanes to the peer's addresses
                if not striped:
                    striped.append(build(STRIPE_CHUNK))
                await self._stripes.run(peer, striped[0], lambda f: f.nbytes, frame,
                                        (lambda f: ranges) if put else None)
                return
            chan = await self._pool.get(peer.name, peer.incarnation, peer.agent)
            await _pieces.run(frames, functools.partial(frame, chan), None)  # every frame pipelined at once

        return run

    # -- the direct lane ----------------------------------------------------------------------

    def mover(self, op: TransferOp, peer: PeerRecord, region: RegionRecord) -> Mover | None:
        """Host regions: a free direct lane, for transfers up to ``DIRECT_MAX_BYTES`` (lanes
        are opened in the background as needed; while none is free, and where a put given up
        on may still land, transfers take the asynchronous path)."""
        key, dtype = region.key, region.dtype
        if (region.device != "cpu" or len(key.encode()) > MAX_KEY_BYTES or len(dtype.encode()) > MAX_DTYPE_BYTES
                or not key or not dtype):
            return None
        put = op == TransferOp.PUT

        def move(local: int, offset: int, nbytes: int) -> bool | Pending:
            if nbytes > DIRECT_MAX_BYTES or (self._unsettled and self._unsettled_at(peer.name, key, offset, nbytes)):
                return False
            lane = self._lane(peer)
            if lane is None or lane.pending:
                return False
            result = lane.start(put, key, dtype, offset, nbytes, local, DIRECT_WAIT_S)
            if result is LaneResult.DONE:
                return True
            if result is LaneResult.PENDING:
                return functools.partial(self._finish, peer.name, lane, (key, offset, nbytes) if put else None)
            log.debug("tcp direct lane to %s: %s; taking the checked path", peer.name, lane.message)
            self._broke_unused(peer.name, lane)
            return False  # refused (nothing written) or broken: the checked path redoes and reports it

        return move

    def _broke_unused(self, peer: str, lane: DirectLane) -> None:
        """A lane that broke before it completed any request (e.g. a target at its cap of
        direct-lane connections closes new ones after their HELLO): no new lane to ``peer`` for
        ``DIRECT_RETRY_S``, rather than a reconnection per transfer."""
        if lane.closed and lane.completed == 0:
            self._failed[peer] = time.monotonic()

    def _lane(self, peer: PeerRecord, open_one: bool = True) -> DirectLane | None:
        """A free (open, nothing pending) direct lane to ``peer``'s incarnation, or None: then,
        with ``open_one``, one more is being opened, unless there are ``DIRECT_LANES_PER_PEER``
        or the last attempt failed less than ``DIRECT_RETRY_S`` ago."""
        lanes: list[DirectLane] = []
        cached = self._lanes.get(peer.name)
        if cached is not None:
            if cached[0] != peer.incarnation:
                self._drop_lane(peer.name)
            else:
                lanes = cached[1]
                lanes[:] = [lane for lane in lanes if not lane.closed]
                for lane in lanes:
                    if not lane.pending:
                        return lane
        since_failed = time.monotonic() - self._failed.get(peer.name, -math.inf)
        if (open_one and len(lanes) < DIRECT_LANES_PER_PEER and peer.name not in self._opening
                and since_failed > DIRECT_RETRY_S):
            self._opening[peer.name] = attempt = object()
            self.ctx.tg.start_soon(self._open_lane, peer, attempt)
        return None

    async def _open_lane(self, peer: PeerRecord, attempt: object) -> None:
        """Connects and says HELLO (lane ``"direct"``), then hands the socket to a native
        :class:`DirectLane`. A failure is remembered (no new attempt for ``DIRECT_RETRY_S``);
        cancelled (the Transport closes), the socket is closed."""
        sock = None
        try:
            with anyio.fail_after(self.ctx.timeout):
                sock = await connect(peer.agent)
                await greet_plain(sock, peer=peer.name, peer_incarnation=peer.incarnation,
                                  hello=hello(self.ctx.name, self.ctx.incarnation, DIRECT_LANE), auth=self.ctx.auth)
            if self._opening.get(peer.name) is not attempt:  # the peer was forgotten meanwhile
                return
            cached = self._lanes.get(peer.name)
            if cached is None or cached[0] != peer.incarnation:
                self._drop_lane(peer.name)
                cached = self._lanes[peer.name] = (peer.incarnation, [])
            cached[1].append(DirectLane(sock))  # (detaches sock)
        except (OSError, TransportError, TimeoutError) as exc:
            self._failed[peer.name] = time.monotonic()
            log.debug("tcp: no direct lane to %s (%s); its transfers take the checked path", peer.name, exc)
        finally:
            if self._opening.get(peer.name) is attempt:
                del self._opening[peer.name]
            if sock is not None:
                close_socket(sock)  # (a no-op once the lane took it)

    async def _finish(self, peer: str, lane: DirectLane, put: tuple[str, int, int] | None) -> bool:
        """Drives ``lane``'s pending request to its end (sending the rest when the socket is
        writable, reading the reply when it is readable): True once the bytes are in place;
        False when it was refused or the connection broke (the checked path then redoes the
        transfer and reports any error). Cancelled, the lane is given up (its reply can no
        longer be matched); a put's bytes (``put``: key, offset, nbytes) may still land, so it
        is abandoned (:meth:`_abandon_lane`), a get's lane closed."""
        try:
            while True:
                await (anyio.wait_writable if lane.writing else anyio.wait_readable)(lane.fileno())
                result = lane.finish(0.0)
                if result is not LaneResult.PENDING:
                    self._broke_unused(peer, lane)
                    return result is LaneResult.DONE
        except BaseException:
            if put is not None and not lane.closed:
                self._abandon_lane(peer, lane, *put)
            else:
                lane.close()
            raise
        finally:
            if lane not in self._lanes.get(peer, ("", []))[1] and lane not in self._settling:  # forgotten meanwhile
                lane.close()

    def _abandon_lane(self, peer: str, lane: DirectLane, key: str, offset: int, nbytes: int) -> None:
        """A put given up on while the direct lane ``lane`` carried it: the target's lane
        thread may still be writing its bytes, so its range is unsettled until that thread has
        ended the connection (:meth:`_abandon`, on a descriptor of our own); ``lane`` is closed
        once it is settled."""
        self._settling.add(lane)

        def settled() -> None:
            self._settling.discard(lane)
            lane.close()

        try:
            sock: socket.socket | None = socket.socket(fileno=os.dup(lane.fileno()))  # (the same connection)
        except OSError as exc:  # (the lane's descriptor is gone: nothing more can arrive by it)
            log.debug("tcp: settling a direct lane to %s: %s", peer, exc)
            sock = None
        self._abandon(peer, [(key, offset, nbytes)], sock, settled)

    def _abandon(self, peer: str, ranges: Sequence[Range], sock: socket.socket | None,
                 settled: Callable[[], None] | None = None) -> None:
        """Puts given up on while the connection ``sock`` (our own descriptor of it, ours to
        close from now on) carried them: the target may still be writing their bytes (those in
        the sockets' buffers), after a later transfer's, unless that one waits. So their
        ``ranges`` stay *unsettled*: transfers to a region that overlap them wait
        (:meth:`_after_unsettled`) until the target has ended that connection, which it does
        only after its last write (we end our side: no more bytes, then read until the end),
        for at most the Transport's timeout; then the connection is reset (what it has not
        sent is dropped). ``settled`` runs then. Used for a direct lane's put
        (:meth:`_abandon_lane`) and for a striping lane's connection (``Stripes``)."""
        entries = []
        for key, offset, nbytes in ranges:
            entry = _Unsettled(offset, offset + nbytes, anyio.Event())
            self._unsettled.setdefault((peer, key), []).append(entry)
            entries.append((key, entry))
        self.ctx.tg.start_soon(self._settle, peer, entries, sock, settled)

    async def _settle(self, peer: str, entries: Sequence[tuple[str, _Unsettled]], sock: socket.socket | None,
                      settled: Callable[[], None] | None) -> None:
        try:
            if sock is not None:
                with sock:
                    sock.setblocking(False)
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_WR)
                    with anyio.move_on_after(self.ctx.timeout) as waited:
                        while True:
                            await anyio.wait_readable(sock)
                            try:
                                if not sock.recv(1 << 16):
                                    break
                            except BlockingIOError:
                                continue
                            except OSError:
                                break
                    if waited.cancelled_caught:
                        log.warning("tcp: %s did not end the connection of a put given up on within %gs; it is reset, "
                                    "and its bytes at %s may still land", peer, self.ctx.timeout,
                                    ", ".join(f"{key!r} {e.lo}..{e.hi}" for key, e in entries[:4]))
                        abort_socket(sock)
        except OSError as exc:  # (the descriptor is gone: nothing more can arrive by it)
            log.debug("tcp: settling a connection to %s: %s", peer, exc)
        finally:
            if settled is not None:
                settled()
            for key, entry in entries:
                entry.done.set()
                waiting = self._unsettled.get((peer, key), [])
                if entry in waiting:
                    waiting.remove(entry)
                if not waiting:
                    self._unsettled.pop((peer, key), None)

    def _unsettled_at(self, peer: str, key: str, offset: int, nbytes: int) -> _Unsettled | None:
        for entry in self._unsettled.get((peer, key), ()):
            if entry.lo < offset + nbytes and offset < entry.hi:
                return entry
        return None

    async def _after_unsettled(self, peer: str, key: str, offset: int, nbytes: int) -> None:
        """Returns once no abandoned put overlapping these bytes may still land (bounded by the
        caller's deadline)."""
        while self._unsettled and (entry := self._unsettled_at(peer, key, offset, nbytes)) is not None:
            await entry.done.wait()

    def _drop_lane(self, peer: str) -> None:
        """Forgets the direct lanes to ``peer`` and closes them (a pending one is closed by
        its ``_finish``)."""
        cached = self._lanes.pop(peer, None)
        for lane in cached[1] if cached is not None else ():
            if not lane.pending:
                lane.close()

    def forget_peer(self, peer: str) -> None:
        self._pool.forget_peer(peer)
        self._stripes.forget_peer(peer)
        self._stages.forget_peer(peer)
        self._drop_lane(peer)
        self._failed.pop(peer, None)
        self._opening.pop(peer, None)  # a lane still being opened to it is dropped when it is

    # -- the target side (the agent's hook) ------------------------------------------------------

    async def serve_frame(self, conn: Conn, kind: int, rid: int, meta: Mapping[str, Any],
                          payload_len: int) -> None:
        """PUT / GET / PUTR / GETR from a peer: the request is parsed and every
        range checked against the live registration before a payload byte is taken; a refusal
        drains the payload (nothing is written; the stream stays in step)."""
        regions = self.ctx.regions
        assert regions is not None, "the Transport gives its backends its region table"
        try:
            if kind in (TcpFrame.PUTR, TcpFrame.GETR):
                runs = RunsRequest.from_meta(meta)
                if payload_len < runs.table_bytes or (kind == TcpFrame.GETR and payload_len != runs.table_bytes):
                    raise WireError(f"a {TcpFrame(kind).name} of {runs.count} runs with {payload_len} payload bytes")
            else:
                request = RangeRequest.from_meta(meta)
                if payload_len != (request.nbytes if kind == TcpFrame.PUT else 0):
                    raise WireError(f"a {TcpFrame(kind).name} of {request.nbytes} bytes with {payload_len} "
                                    "payload bytes")
        except TransportError as exc:
            await conn.refuse(rid, exc, discard=payload_len)
            return
        if kind in (TcpFrame.PUTR, TcpFrame.GETR):
            await serve_runs(regions, conn, kind, rid, runs, payload_len, self.ctx.copier)
        else:
            await serve_range(regions, conn, kind, rid, request, payload_len)

    def adopt_lane(self, lane: str, sock: socket.socket) -> bool:
        """A direct-lane connection: served on a native thread (``transport._native.tcp``),
        its requests checked against the native region mirror."""
        if self._direct is None:
            self._direct = DirectServer(self._mirror, self.ctx.name, self.ctx.timeout, DIRECT_MAX_CONNS)
        return self._direct.adopt(sock)

    def region_added(self, region: Region) -> None:
        if region.view is not None:  # host memory: the direct lane may serve it
            self._mirror.set(region.key, region.address, region.nbytes, region.dtype.itemsize, region.writable,
                             dtype_name(region.dtype))
        self._release()

    def region_removed(self, region: Region) -> None:
        token = next(self._tokens)
        if self._mirror.remove(region.key, token):
            self._retired[token] = region
        self._release()

    def region_moved(self, key: str) -> None:
        self._mirror.mark_moved(key)
        self._release()

    def _release(self) -> None:
        """Lets go of withdrawn regions whose memory no direct-lane request uses any more."""
        for token in self._mirror.released():
            self._retired.pop(token, None)

    def close(self) -> None:
        self._pool.close()
        self._stripes.close()
        for peer in list(self._lanes):
            self._drop_lane(peer)
        if self._direct is not None:  # ends the direct-lane connections and joins their threads
            self._direct.close()
            self._direct = None
        self._mirror.clear()
        self._retired.clear()


@dataclasses.dataclass(eq=False)
class _Unsettled:
    """The range of a put given up on while another connection carried it (see ``TcpBackend._abandon``)."""

    lo: int
    hi: int
    done: anyio.Event


class _Stages:
    """A Transport's tcp staging buffers of MAX_STAGED_BYTES, each lent to one frame at a time,
    and the native copies in and out.

    At most ``_STAGE_PER_PEER`` frames to one peer hold a buffer at once, and a frame waits only
    for its own peer's: a peer that stops reading holds that many buffers, never every other
    peer's frames (a shared pool of four let one stalled relay hold up a trainer's pushes to
    every other host until it was given up on). Up to ``_STAGE_BUFFERS`` buffers are kept for
    reuse; more are made while more peers have frames in flight (at most ``_STAGE_MAX`` lent at
    once), and dropped after."""

    def __init__(self, copier: Copier) -> None:
        self._copier = copier
        self._free: list[tuple[memoryview, int, Any]] = []
        self._peers: dict[str, anyio.Semaphore] = {}
        self._total = anyio.Semaphore(_STAGE_MAX)

    @contextlib.asynccontextmanager
    async def buffer(self, peer: str) -> AsyncIterator[tuple[memoryview, int]]:
        """A buffer for one frame to ``peer``, once fewer than ``_STAGE_PER_PEER`` of its frames
        hold one."""
        turn = self._peers.get(peer)
        if turn is None:
            turn = self._peers[peer] = anyio.Semaphore(_STAGE_PER_PEER)
        async with turn, self._total:
            if self._free:
                item = self._free.pop()
            else:
                arr = np.empty(MAX_STAGED_BYTES, dtype=np.uint8)
                item = (memoryview(arr), int(arr.ctypes.data), arr)  # type: ignore[arg-type]  # ndarray is a Buffer
            try:
                yield item[0], item[1]
            finally:
                if len(self._free) < _STAGE_BUFFERS:
                    self._free.append(item)

    def forget_peer(self, peer: str) -> None:
        """Drops ``peer``'s turn (frames still holding a buffer return it as usual)."""
        self._peers.pop(peer, None)

    async def copy(self, rows: np.ndarray, address: int, *, to_stage: bool, nbytes: int) -> None:
        """Packs (``to_stage``) or unpacks a frame's runs with one native copy job.

        Raises:
            TransportInternalError: the copy failed (a bug: both sides are this process's memory).
        """
        stage = rows[:, 0] + address
        dst, src = (stage, rows[:, 1]) if to_stage else (rows[:, 1], stage)
        job = np.stack([dst, src, rows[:, 2]], axis=1).astype(np.uint64).tobytes()
        result = await self._copier.copy_packed(CopyKind.LOCAL, 0, job, nbytes)
        if result.status != CopyStatus.OK:
            raise TransportInternalError(f"tcp: staging copy of {len(rows)} runs failed (errno {result.err})")
