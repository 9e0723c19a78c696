"""``tcp``: any hosts, no extra dependencies.

Bytes travel over one connection per peer to the peer's agent, which checks key, dtype, bounds
and writability and then receives them straight into the registered region (``recv_into``, no
intermediate copy). Not one-sided at the process level: the target's agent, inside its
``async with Transport``, serves the request, but the target's application code does nothing.

Both sides live here: :class:`TcpBackend` (the initiator) and :func:`serve_ranges` (the target's
agent routes PUT / GET frames to it).
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from .._agent import ChannelPool, Conn, hello
from .._errors import BackendUnavailableError, TransportError
from .._regions import RegionTable
from .._tensors import MemoryKind, dtype_name
from .._wire import FrameKind, PeerRecord, RangeRequest, RangesRequest, RegionRecord, TransferOp
from ._base import Backend, BackendContext, LocalBuffer, RemoteTarget

_FRAME_SEGMENTS = 2048  # ranges per PUTV / GETV frame (its segment table stays well under MAX_META)


class TcpBackend(Backend):
    name = "tcp"
    one_sided = False
    memory_kinds = frozenset({MemoryKind.CPU})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._pool = ChannelPool(ctx.tg, hello(ctx.name, ctx.incarnation, "tcp"), ctx.auth)

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        if region.device != "cpu":
            return f"{region.key!r} is device memory ({region.device}); the agent's byte stream writes host memory only"
        return None

    @staticmethod
    def _request(local: LocalBuffer, remote: RemoteTarget) -> RangeRequest:
        return RangeRequest(remote.region.key, dtype_name(local.tensor.dtype), remote.offset, remote.nbytes)

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        await chan.request(FrameKind.PUT, self._request(local, remote).to_meta(), payload=local.view)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        await chan.request(FrameKind.GET, self._request(local, remote).to_meta(), into=local.view)

    async def move_many(self, op: TransferOp, pairs: Sequence[tuple[LocalBuffer, RemoteTarget]]) -> None:
        """The ranges go as PUTV / GETV frames of up to ``_FRAME_SEGMENTS`` ranges each (the
        target checks every range of a frame before it takes a byte), pipelined on the peer's
        connection."""
        if len(pairs) == 1:
            await self.move(op, *pairs[0])
            return
        peer = pairs[0][1].peer
        chan = await self._pool.get(peer.name, peer.incarnation, peer.agent)
        kind = FrameKind.PUTV if op == TransferOp.PUT else FrameKind.GETV
        errors: list[TransportError] = []

        async def frame(chunk: Sequence[tuple[LocalBuffer, RemoteTarget]]) -> None:
            request = RangesRequest(tuple(self._request(loc, r).segments[0] for loc, r in chunk))
            views = [loc.view for loc, _ in chunk]
            try:
                if op == TransferOp.PUT:
                    await chan.request(kind, request.to_meta(), payload=views)
                else:
                    await chan.request(kind, request.to_meta(), into=views)
            except TransportError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(0, len(pairs), _FRAME_SEGMENTS):
                tg.start_soon(frame, pairs[i : i + _FRAME_SEGMENTS])
        if errors:
            raise errors[0]

    def forget_peer(self, peer: str) -> None:
        self._pool.forget_peer(peer)

    def close(self) -> None:
        self._pool.close()


async def serve_ranges(regions: RegionTable, conn: Conn, kind: FrameKind, rid: int,
                       ranges: Sequence[tuple[str, str, int, int]], payload_len: int) -> None:
    """The target side of a tcp PUT / GET (one range) or PUTV / GETV (many): every range is
    checked against the live registration before any byte is taken (one refused range refuses
    the frame; its payload is read and dropped, so nothing is written and the stream stays in
    step); then the payload is received straight into the regions, range by range (or the
    ranges are sent back)."""
    op = TransferOp.PUT if kind in (FrameKind.PUT, FrameKind.PUTV) else TransferOp.GET
    views = []
    try:
        for key, dtype, offset, nbytes in ranges:
            region = regions.check(op, key, dtype, offset, nbytes)
            if region.view is None:
                raise BackendUnavailableError(f"{regions.owner}:{key!r} is device memory; the agent's byte "
                                              "stream cannot reach it")
            views.append(region.view[offset : offset + nbytes])
    except TransportError as exc:
        await conn.discard(payload_len)
        await conn.refuse(rid, exc)
        return
    if op == TransferOp.PUT:
        for view in views:
            await conn.recv_into(view)
        await conn.reply(FrameKind.OK, rid, {})
    else:
        await conn.reply(FrameKind.DATA, rid, {}, views)
