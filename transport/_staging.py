"""Bounce buffers: every path that moves a transfer through memory of the other kind.

* device memory over a host-memory backend (tcp, ucx, CMA-only ipc): pinned host staging;
* host memory over a device-memory backend (nccl): a GPU buffer.

A :class:`Bounce` is driven by whoever moves the bytes, piece by piece (one piece schedule,
:func:`staging_pieces`), so a huge tensor never needs a huge buffer and no
closure is handed down to be called back::

    async with bounce(local, nbytes, copier) as b:
        for pos, size in b.pieces:
            if op is PUT:
                await b.load(pos, size)           # the tensor -> the buffer
                await move(b.buffer(size), pos)  # the buffer -> the peer
            else:
                await move(b.buffer(size), pos)  # the peer -> the buffer
                await b.store(pos, size)          # the buffer -> the tensor
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import torch

from . import _cuda, _tensor_kernels
from ._cuda_copier import CudaCopier
from ._tensors import LocalBuffer, MemoryKind

# A transfer moved through a bounce buffer goes in pieces of at most this size.
STAGING_CHUNK = 64 << 20


def staging_chunk(granule: int) -> int:
    """The largest multiple of ``granule`` (an element size) within ``STAGING_CHUNK``."""
    return max(granule, STAGING_CHUNK // granule * granule)


def staging_pieces(nbytes: int, granule: int) -> list[tuple[int, int]]:
    """(byte offset, size) of the pieces ``nbytes`` are staged in: whole elements of
    ``granule`` bytes, at most one chunk each."""
    chunk = staging_chunk(granule)
    return [(pos, min(chunk, nbytes - pos)) for pos in range(0, nbytes, chunk)]


class Bounce(abc.ABC):
    """Moves one transfer's bytes between ``local`` and a buffer of the other memory kind.

    Get one from :func:`bounce`; it is valid inside that ``async with`` only.
    """

    def __init__(self, local: LocalBuffer, nbytes: int) -> None:
        self.local = local
        self.nbytes = nbytes
        self.pieces = staging_pieces(nbytes, local.tensor.dtype.itemsize)

    @abc.abstractmethod
    def buffer(self, size: int) -> LocalBuffer:
        """The first ``size`` bytes of the bounce buffer, as the moving backend sees them."""

    @abc.abstractmethod
    async def load(self, pos: int, size: int) -> None:
        """Copies bytes ``[pos, pos+size)`` of the transfer from the tensor into the buffer."""

    @abc.abstractmethod
    async def store(self, pos: int, size: int) -> None:
        """Copies the buffer's first ``size`` bytes to bytes ``[pos, pos+size)`` of the tensor."""


class PinnedBounce(Bounce):
    """A CUDA tensor through one pinned host buffer of the CUDA copier's pool."""

    def __init__(self, copier: CudaCopier, local: LocalBuffer, nbytes: int, buf: _cuda.PinnedBuffer) -> None:
        super().__init__(local, nbytes)
        self._copier = copier
        self._device = local.tensor.device.index
        self._buf = buf

    @property
    def address(self) -> int:
        """The pinned buffer's host address (for a native copy straight into it)."""
        return self._buf.address

    def buffer(self, size: int) -> LocalBuffer:
        return LocalBuffer(self._buf.tensor[:size].view(self.local.tensor.dtype), MemoryKind.CPU)

    async def load(self, pos: int, size: int) -> None:
        await self._copier.copy(self._buf.address, self.local.address + pos, size, self._device, self.local.ready)

    async def store(self, pos: int, size: int) -> None:
        await self._copier.copy(self.local.address + pos, self._buf.address, size, self._device, self.local.ready)


class DeviceBounce(Bounce):
    """A host tensor through one buffer on the current GPU (for device-memory backends)."""

    def __init__(self, local: LocalBuffer, nbytes: int, gpu: torch.Tensor) -> None:
        super().__init__(local, nbytes)
        self._host = _tensor_kernels.as_bytes(local.tensor)
        self._gpu = gpu
        self._ready: Any = None  # the event of the last load (a put's piece is read after it)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:  # on a worker thread: it may block
        dst.copy_(src)
        return _cuda.ready_event(self._gpu)  # what the backend waits for before reading the buffer

    def buffer(self, size: int) -> LocalBuffer:
        ready = self._ready if self._ready is not None else _cuda.ready_event(self._gpu)
        return LocalBuffer(self._gpu[:size].view(self.local.tensor.dtype), MemoryKind.CUDA, ready)

    async def load(self, pos: int, size: int) -> None:
        self._ready = await anyio.to_thread.run_sync(self._copy, self._gpu[:size], self._host[pos : pos + size])

    async def store(self, pos: int, size: int) -> None:
        await anyio.to_thread.run_sync(self._copy, self._host[pos : pos + size], self._gpu[:size])


@contextlib.asynccontextmanager
async def bounce(local: LocalBuffer, nbytes: int, copier: Callable[[], CudaCopier]) -> AsyncIterator[Bounce]:
    """A bounce buffer for moving ``nbytes`` of ``local`` over a backend of the other memory
    kind: pinned host memory (from ``copier()``'s pool) for a CUDA tensor, a buffer on the
    current GPU for a host tensor. At most one staging chunk, whatever ``nbytes`` is."""
    chunk = min(nbytes, staging_chunk(local.tensor.dtype.itemsize))
    if local.kind == MemoryKind.CUDA:
        eng = copier()
        buf = await eng.acquire_staging(chunk, local.tensor.device.index)
        try:
            yield PinnedBounce(eng, local, nbytes, buf)
        finally:
            eng.release_staging(buf)
    else:
        gpu = torch.empty(chunk, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        yield DeviceBounce(local, nbytes, gpu)


def staging_kind(kind: MemoryKind) -> MemoryKind:
    """The memory a transfer of ``kind`` memory is staged through for a backend that does not
    serve ``kind``."""
    return MemoryKind.CPU if kind == MemoryKind.CUDA else MemoryKind.CUDA
