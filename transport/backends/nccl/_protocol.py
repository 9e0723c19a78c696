"""The nccl backend's requests to a peer's agent (``FrameKind.BACKEND``, lane "nccl").

Every request is one JSON metadata dict: ``{"backend": "nccl", "op": ..., "from": <name>,
"from_incarnation": <incarnation>, ...}``. The ops (:class:`Op`):

- ``open``: join communicator ``cid`` (its unique id is in the store) on GPU ``device``;
  ``pair`` names the GPU pair, ``timeout`` bounds the join. Reply ``{"comm": "ok", "nccl": [...]}``.
- ``post``: enqueue your side of transfer ``seq`` on ``cid`` (``dir``, ``key``, ``dtype``,
  ``offset``, ``nbytes``, ``timeout``). Reply ``{"comm": "ok"}``, or ``{"comm": "gone"}`` when the
  target no longer has the communicator (nothing was enqueued). Refusals are typed errors.
- ``close``: abort your side of ``cid``. Reply ``{"comm": "closed"}``.
- ``self``: a transfer to this very Transport (``ticket``, ``dir``, region fields).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping
from typing import Any

import anyio

from ..._channel import ChannelPool, hello
from ..._errors import TransportError, TransportInternalError
from ..._wire import FrameKind, PeerRecord, TransferOp
from .._base import BackendContext

log = logging.getLogger(__name__)

MAX_ID_LEN = 512  # longest string field (comm id, peer name, ...) a request may carry
CLOSE_TIMEOUT_S = 5.0  # how long a best-effort ``close`` request may take


class Op(enum.Enum):
    """Requests the nccl backend sends to a peer's agent (``meta["op"]``)."""

    OPEN = "open"
    POST = "post"
    CLOSE = "close"
    SELF = "self"


def direction_of(meta: Mapping[str, Any]) -> TransferOp:
    """The direction a request names (``meta["dir"]``: "put" or "get", seen from the initiator).

    Raises:
        TransportInternalError: ``dir`` is missing or not "put"/"get".
    """
    value = meta.get("dir")
    try:
        return TransferOp(value)
    except ValueError:
        raise TransportInternalError(f"bad nccl request: dir={value!r}") from None


class Requests:
    """This endpoint's requests to peers' agents: one connection per peer, opened on first use.

    Args:
        ctx: the backend's context (name, incarnation, token, task group, default timeout).
    """

    def __init__(self, ctx: BackendContext) -> None:
        self._ctx = ctx
        self._pool = ChannelPool(ctx.tg, hello(ctx.name, ctx.incarnation, "nccl"), ctx.auth)
        self._closed = False

    def meta(self, op: Op | str, **fields: Any) -> dict[str, Any]:
        """The metadata of a request ``op`` from this endpoint."""
        name = op.value if isinstance(op, Op) else op
        return {"backend": "nccl", "op": name, "from": self._ctx.name, "from_incarnation": self._ctx.incarnation,
                **fields}

    async def send(self, peer: PeerRecord, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Sends one request to ``peer``'s agent and returns the reply.

        Raises:
            PeerLostError: the connection broke. TransportError subclasses: the agent refused.

        Cancellation: as ``Channel.request`` (once on the wire the frame is finished; the reply is
        then not awaited).
        """
        chan = await self._pool.get(peer.name, peer.incarnation, peer.agent)
        return await chan.request(FrameKind.BACKEND, meta)

    def tell_close(self, peer: PeerRecord, cid: str) -> None:
        """Asks ``peer`` to abort its side of ``cid``, best effort, in the background (its
        posted operations would otherwise wait for its own deadline). Nothing once closed."""
        if self._closed:
            return

        async def close() -> None:
            with anyio.move_on_after(min(CLOSE_TIMEOUT_S, self._ctx.timeout)):
                try:
                    await self.send(peer, self.meta(Op.CLOSE, cid=cid))
                except TransportError as exc:
                    log.debug("transport %s: could not tell %s to close comm %s: %s",
                              self._ctx.name, peer.name, cid, exc)

        self._ctx.tg.start_soon(close)

    def forget_peer(self, peer: str) -> None:
        """Closes the connection to ``peer`` (it left or restarted)."""
        self._pool.forget_peer(peer)

    def close(self) -> None:
        self._closed = True
        self._pool.close()


def remaining(default: float) -> float:
    """Seconds left before the current deadline (the transfer's), else ``default``."""
    left = anyio.current_effective_deadline() - anyio.current_time()
    return default if math.isinf(left) else max(0.0, left)


def meta_str(meta: Mapping[str, Any], key: str) -> str:
    """A non-empty string field of a request.

    Raises:
        TransportInternalError: missing, not a string, or longer than ``MAX_ID_LEN``.
    """
    value = meta.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise TransportInternalError(f"bad nccl request: {key}={value!r}")
    return value


def meta_int(meta: Mapping[str, Any], key: str) -> int:
    """An integer field of a request.

    Raises:
        TransportInternalError: missing or not an integer.
    """
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TransportInternalError(f"bad nccl request: {key}={value!r}")
    return value


def meta_timeout(meta: Mapping[str, Any], default: float) -> float:
    """The request's ``timeout`` (seconds, at most a day), else ``default``."""
    value = meta.get("timeout", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        return default
    return min(float(value), 24 * 3600.0)
