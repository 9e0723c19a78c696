"""``tcp``: any hosts, no extra dependencies.

Bytes travel over one connection per peer to the peer's agent, which checks key, dtype, bounds
and writability and then receives them straight into the registered region (``recv_into``, no
intermediate copy). Not one-sided at the process level: the target's agent, inside its
``async with Transport``, serves the request, but the target's application code does nothing.
"""

from __future__ import annotations

from .._agent import ChannelPool
from .._tensors import MemoryKind, dtype_name
from .._wire import FrameKind, PeerRecord, RegionRecord
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
        self._pool = ChannelPool(ctx.tg, {"from": ctx.name, "from_incarnation": ctx.incarnation, "lane": "tcp"}, ctx.auth)

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        if region.device != "cpu":
            return f"{region.key!r} is device memory ({region.device}); the agent's byte stream writes host memory only"
        return None

    def _meta(self, local: LocalBuffer, remote: RemoteTarget) -> dict[str, object]:
        return {
            "key": remote.region.key,
            "dtype": dtype_name(local.tensor.dtype),
            "offset": remote.offset,
            "nbytes": remote.nbytes,
        }

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        await chan.request(FrameKind.PUT, self._meta(local, remote), payload=local.view)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        chan = await self._pool.get(remote.peer.name, remote.peer.incarnation, remote.peer.agent)
        await chan.request(FrameKind.GET, self._meta(local, remote), into=local.view)

    def forget_peer(self, peer: str) -> None:
        self._pool.forget(peer)

    def close(self) -> None:
        self._pool.close()
