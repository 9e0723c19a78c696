"""``tcp``: any hosts, no extra dependencies.

Bytes travel over one connection per peer to the peer's agent, which checks key, dtype, bounds
and writability and then receives them straight into the registered region (``recv_into``, no
intermediate copy). Not one-sided at the process level: the target's agent, inside its
``async with Transport``, serves the request, but the target's application code does nothing.

Both sides live here: :class:`TcpBackend` (the initiator) and :func:`serve_range` (the target's
agent routes PUT / GET frames to it).
"""

from __future__ import annotations

from .._agent import ChannelPool, Conn, hello
from .._errors import BackendUnavailableError, TransportError
from .._regions import RegionTable
from .._tensors import MemoryKind, dtype_name
from .._wire import FrameKind, PeerRecord, RangeRequest, RegionRecord, TransferOp
from ._base import Backend, BackendContext, LocalBuffer, RemoteTarget


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
    def _request(local: LocalBuffer, remote: RemoteTarget) -> dict[str, object]:
        return RangeRequest(remote.region.key, dtype_name(local.tensor.dtype), remote.offset, remote.nbytes).to_meta()

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        await chan.request(FrameKind.PUT, self._request(local, remote), payload=local.view)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        await chan.request(FrameKind.GET, self._request(local, remote), into=local.view)

    def forget_peer(self, peer: str) -> None:
        self._pool.forget_peer(peer)

    def close(self) -> None:
        self._pool.close()


async def serve_range(regions: RegionTable, conn: Conn, kind: FrameKind, rid: int, request: RangeRequest,
                      payload_len: int) -> None:
    """The target side of one tcp PUT / GET: checks the request against the live registration,
    then receives the payload straight into the region (or sends the range back). A refused
    request's payload is read and dropped, so nothing is written and the stream stays in step."""
    op = TransferOp.PUT if kind == FrameKind.PUT else TransferOp.GET
    try:
        region = regions.check(op, request.key, request.dtype, request.offset, request.nbytes)
        if region.view is None:
            raise BackendUnavailableError(
                f"{regions.owner}:{region.key!r} is device memory; the agent's byte stream cannot reach it"
            )
    except TransportError as exc:
        await conn.discard(payload_len)
        await conn.refuse(rid, exc)
        return
    view = region.view[request.offset : request.offset + request.nbytes]
    if kind == FrameKind.PUT:
        await conn.recv_into(view)
        await conn.reply(FrameKind.OK, rid, {})
    else:
        await conn.reply(FrameKind.DATA, rid, {}, view)
