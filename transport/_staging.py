"""Bounce buffers: every path that moves a transfer through memory of the other kind.

* device memory over a host-memory backend (tcp, ucx, CMA-only ipc): pinned host staging;
* host memory over a device-memory backend (nccl): a GPU buffer.

A :class:`Bounce` moves the transfer through its one buffer piece by piece, at most one
staging chunk each (:func:`staging_pieces`, on the piece schedule of ``transport._pieces``),
so a huge tensor never needs a huge buffer. Whoever moves the bytes hands it the one step that
is theirs, between the buffer and the peer::

    async with bounce(local, nbytes, copier) as b:
        await b.each(op, move)  # a put: load a piece, move(buffer, pos, size); a get: the reverse

Runs of a prepared transfer that need a bounce buffer each go through one, one run at a time
(``STAGED_INFLIGHT``).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import torch

from . import _cuda, _pieces, _tensor_kernels
from ._cuda_copier import CudaCopier
from ._pieces import ready_of
from ._tensors import LocalBuffer, MemoryKind
from ._wire import TransferOp

# A transfer moved through a bounce buffer goes in pieces of at most this size.
STAGING_CHUNK = 64 << 20
# Runs of a prepared transfer moved through bounce buffers at once (a buffer each).
STAGED_INFLIGHT = 1


def staging_chunk(granule: int) -> int:
    """The largest multiple of ``granule`` (an element size) within ``STAGING_CHUNK``."""
    return max(granule, STAGING_CHUNK // granule * granule)


def staging_pieces(nbytes: int, granule: int) -> list[tuple[int, int]]:
    """(byte offset, size) of the pieces ``nbytes`` are staged in: whole elements of
    ``granule`` bytes, at most one chunk each."""
    return _pieces.cut(nbytes, staging_chunk(granule))


class Bounce(abc.ABC):
    """Moves one transfer's bytes between ``local`` and a buffer of the other memory kind.

    Get one from :func:`bounce`; it is valid inside that ``async with`` only.
    """

    def __init__(self, local: LocalBuffer, nbytes: int) -> None:
        self.local = local
        self.nbytes = nbytes
        self.pieces = staging_pieces(nbytes, local.tensor.dtype.itemsize)

    async def each(self, op: TransferOp, move: Callable[[LocalBuffer, int, int], Awaitable[None]]) -> None:
        """Moves the transfer through the buffer, one piece after the other:
        ``move(buffer, pos, size)`` moves the buffer's first ``size`` bytes to (a put) or from
        (a get) the peer's side of the transfer's bytes ``[pos, pos+size)``; a put loads each
        piece into the buffer before it, a get stores it into the tensor after.

        Raises:
            What ``move``, :meth:`load` or :meth:`store` raise, the first (no piece after it
            is moved). Cancellation: as ``transport._pieces.run``.
        """
        put = op == TransferOp.PUT

        async def piece(at: tuple[int, int]) -> None:
            pos, size = at
            if put:
                await self.load(pos, size)
            await move(self.buffer(size), pos, size)
            if not put:
                await self.store(pos, size)

        await _pieces.run(self.pieces, piece, 1)

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
        await self._copier.copy(self._buf.address, self.local.address + pos, size, self._device, ready_of(self.local))

    async def store(self, pos: int, size: int) -> None:
        await self._copier.copy(self.local.address + pos, self._buf.address, size, self._device, ready_of(self.local))


class DeviceBounce(Bounce):
    """A host tensor through one buffer on the current GPU (for device-memory backends).

    The buffer's ready event (what the backend's stream waits for before it touches the
    buffer) is recorded once, when the buffer is allocated, on the current stream it was
    allocated for: the caching allocator may hand out memory that work queued there still
    uses. It is not a transfer's ready event (the tensor is host memory; the buffer did not
    exist when the transfer started). The copies between the tensor and the buffer are
    synchronous (``copy_`` without ``non_blocking``), on a worker thread but on that stream: a
    loaded piece is on the device when :meth:`load` returns, and a stored one in the tensor
    when :meth:`store` does.
    """

    def __init__(self, local: LocalBuffer, nbytes: int, gpu: torch.Tensor) -> None:
        super().__init__(local, nbytes)
        self._host = _tensor_kernels.as_bytes(local.tensor)
        self._gpu = gpu
        self._ready = _cuda.ready_event(gpu)
        # The stream the buffer was allocated for: the copies run on it (from the worker
        # thread, whose own current stream is the default one), after the work queued there
        # that may still use the recycled memory.
        self._stream = torch.cuda.current_stream(gpu.device)

    def buffer(self, size: int) -> LocalBuffer:
        return LocalBuffer(self._gpu[:size].view(self.local.tensor.dtype), MemoryKind.CUDA, self._ready)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src)

    async def load(self, pos: int, size: int) -> None:
        await anyio.to_thread.run_sync(self._copy, self._gpu[:size], self._host[pos : pos + size])

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
