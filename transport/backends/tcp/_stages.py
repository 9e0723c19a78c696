"""The ``tcp`` backend's staging buffers: a prepared transfer's small runs travel packed into one
buffer of ``MAX_STAGED_BYTES`` per frame (see ``TcpBackend.prepare_runs``); :class:`Stages`
lends those buffers and makes the native copies in and out of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np

from ..._errors import TransportInternalError
from ..._native import Copier, CopyKind, CopyStatus
from ._frames import MAX_STAGED_BYTES

_STAGE_BUFFERS = 4  # staging buffers of MAX_STAGED_BYTES a Transport keeps for reuse
_STAGE_PER_PEER = 2  # staged frames to one peer that hold a buffer at once (see Stages)
_STAGE_MAX = 64  # staging buffers a Transport lends at once, all peers together (256 MiB)


class Stages:
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
