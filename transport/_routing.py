"""Running one transfer: validate it against the peer's record, choose a backend, move the
bytes (staging CUDA tensors through pinned host memory for host-only backends), and settle its
outcome (flight recorder, peer loss).

``TransferRunner`` is a mixin of :class:`transport.Transport`, like ``PeerDirectory``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio
import torch

from . import _cuda, _kernels
from ._errors import (
    BackendUnavailableError,
    BoundsError,
    ClosedError,
    DTypeMismatchError,
    PeerLostError,
    ReadOnlyRegionError,
    RegistrationError,
    TransferAbortedError,
    TransferTimeoutError,
    TransportError,
    TransportInternalError,
)
from ._flight import OpState
from ._tensors import MemoryKind, dtype_name
from ._transfer import Transfer, TransferOp
from ._wire import PeerRecord, RegionRecord
from .backends import Backend, LocalBuffer, RemoteTarget

if TYPE_CHECKING:
    from ._transport import Transport

log = logging.getLogger("transport._transport")


def _staging_kind(kind: MemoryKind) -> MemoryKind:
    """The memory a transfer of ``kind`` memory is staged through for a backend that does not
    serve ``kind``."""
    return MemoryKind.CPU if kind == MemoryKind.CUDA else MemoryKind.CUDA


class TransferRunner:
    def _check_remote(self: Transport, record: PeerRecord, xfer: Transfer, dtype: torch.dtype) -> RegionRecord:
        region = record.regions.get(xfer.key)
        where = f"{xfer.op.value} {xfer.nbytes} bytes at offset {xfer.offset} of {record.name}:{xfer.key!r}"
        if region is None:
            known = ", ".join(sorted(record.regions)[:8]) or "none"
            raise RegistrationError(f"{where}: {record.name} has no region {xfer.key!r} (it has: {known})")
        if region.dtype != dtype_name(dtype):
            raise DTypeMismatchError(f"{where}: local dtype {dtype_name(dtype)} but the region is {region.dtype}")
        itemsize = dtype.itemsize
        if xfer.offset < 0 or xfer.offset + xfer.nbytes > region.nbytes:
            raise BoundsError(f"{where}: outside the region's {region.nbytes} bytes")
        if xfer.offset % itemsize:
            raise BoundsError(f"{where}: offset is not a multiple of the {region.dtype} element size {itemsize}")
        if xfer.op == TransferOp.PUT and not region.writable:
            raise ReadOnlyRegionError(f"{where}: {record.name} registered {xfer.key!r} read-only")
        return region

    def _choose(self: Transport, record: PeerRecord, region: RegionRecord, kind: MemoryKind) -> Backend:
        """The first backend that can move bytes between ``kind`` memory here and ``region``.
        A host-memory backend serves local CUDA tensors through pinned staging, a device-memory
        backend (nccl) local host tensors through a device buffer (see _staged)."""
        reasons = []
        for b in self._backends:
            # The memory it would touch here: the tensor itself, or a staging copy of it.
            touch = kind if kind in b.memory_kinds else _staging_kind(kind)
            if b.name not in record.backends:
                reasons.append(f"{b.name}: {record.name} does not speak it")
            elif touch not in b.memory_kinds:
                reasons.append(f"{b.name}: does not serve {kind.value} memory")
            elif touch != kind and touch == MemoryKind.CUDA and (why := _cuda.unavailable_reason()) is not None:
                reasons.append(f"{b.name}: serves {kind.value} memory through a GPU buffer, but {why}")
            elif (why := b.unreachable_reason(record, region, touch)) is not None:
                reasons.append(f"{b.name}: {why}")
            else:
                if reasons and (record.name, b.name) not in self._fallbacks_logged:
                    self._fallbacks_logged.add((record.name, b.name))
                    log.warning("transport %s: using %s for %s because %s", self.name, b.name, record.name, "; ".join(reasons))
                return b
        raise BackendUnavailableError(
            f"no backend can reach {record.name}:{region.key!r} from {kind.value} memory "
            f"(we speak {', '.join(self.backends) or 'nothing'}; it speaks {', '.join(record.backends) or 'nothing'}): "
            + "; ".join(reasons)
        )

    async def _execute(self: Transport, xfer: Transfer, local: LocalBuffer) -> None:
        tensor, kind = local.tensor, local.kind
        record = await self._resolve(xfer.peer)
        if any((seq := b.live_seq(record)) is not None and seq != record.seq for b in self._backends):
            record = await self._resolve(xfer.peer, refresh=True)  # it (un)registered since
        try:
            region = self._check_remote(record, xfer, tensor.dtype)
        except (RegistrationError, DTypeMismatchError, BoundsError):
            # Our copy of the record may predate a (re-)registration: check the current one.
            record = await self._resolve(xfer.peer, refresh=True)
            region = self._check_remote(record, xfer, tensor.dtype)
        if self._stale(record):
            raise PeerLostError(f"{record.name} (pid {record.pid}) has exited")
        backend = self._choose(record, region, kind)
        xfer.backend = backend.name
        if xfer.nbytes == 0:
            return
        remote = RemoteTarget(record, region, xfer.offset, xfer.nbytes)
        xfer._moving = True
        xfer._incarnation = record.incarnation
        self._flight.transition(xfer._rec, OpState.MOVING, backend=backend.name)
        if kind not in backend.memory_kinds:
            await self._staged(backend, xfer.op, local, remote)
        elif xfer.op == TransferOp.PUT:
            await backend.put(local, remote)
        else:
            await backend.get(local, remote)

    async def _staged(self: Transport, backend: Backend, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Moves a CUDA tensor over a host-memory backend through pinned staging, or a host
        tensor over a device-memory backend through a GPU buffer, in pieces."""
        dtype = local.tensor.dtype
        if local.kind == MemoryKind.CPU:
            await self._staged_on_gpu(backend, op, local, remote)
            return

        async def move(buf: _cuda.PinnedBuffer, pos: int, size: int) -> None:
            host = LocalBuffer(buf.tensor[:size].view(dtype), MemoryKind.CPU)
            part = RemoteTarget(remote.peer, remote.region, remote.offset + pos, size)
            await (backend.put(host, part) if op == TransferOp.PUT else backend.get(host, part))

        await self._cuda_engine().staged(local.address, remote.nbytes, local.tensor.device.index, local.ready,
                                         op == TransferOp.PUT, move, dtype.itemsize)

    async def _staged_on_gpu(self: Transport, backend: Backend, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        host, n, dtype = _kernels.as_bytes(local.tensor), remote.nbytes, local.tensor.dtype
        gpu = torch.empty(min(n, _cuda.staging_chunk(dtype.itemsize)), dtype=torch.uint8,
                          device=torch.device("cuda", torch.cuda.current_device()))

        def copy(dst: torch.Tensor, src: torch.Tensor) -> Any:  # on a worker thread: it may block
            dst.copy_(src)
            return _cuda.ready_event(gpu)  # what the backend waits for before reading the buffer

        for pos, size in _cuda.staging_pieces(n, dtype.itemsize):
            part = RemoteTarget(remote.peer, remote.region, remote.offset + pos, size)
            piece = gpu[:size]
            if op == TransferOp.PUT:
                ready = await anyio.to_thread.run_sync(copy, piece, host[pos : pos + size])
                await backend.put(LocalBuffer(piece.view(dtype), MemoryKind.CUDA, ready), part)
            else:
                await backend.get(LocalBuffer(piece.view(dtype), MemoryKind.CUDA, _cuda.ready_event(gpu)), part)
                await anyio.to_thread.run_sync(copy, host[pos : pos + size], piece)

    def _cuda_engine(self: Transport) -> _cuda.CudaEngine:
        if self._cuda is None:
            self._cuda = _cuda.CudaEngine()
        return self._cuda

    async def _run(self: Transport, xfer: Transfer, local: LocalBuffer, timeout: float) -> None:
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
                xfer._scope = scope
                if xfer._cancel_requested:
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()  # deliver it before anything moves
                error: TransportError | None = None
                try:
                    await self._execute(xfer, local)
                except TransportError as exc:
                    error = exc
                except Exception as exc:
                    log.exception("transport %s: unexpected failure in %r", self.name, xfer)
                    error = TransportInternalError(f"{xfer!r} failed unexpectedly: {type(exc).__name__}: {exc}")
                    error.__cause__ = exc
                xfer._finish(error)
            if not xfer.done():  # our scope absorbed a cancellation: user cancel, deadline, peer loss
                what = f"{xfer.op.value} of {xfer.nbytes} bytes to {xfer.peer}:{xfer.key!r}"
                partial = xfer._moving
                if xfer._abort_error is not None:
                    xfer._finish(xfer._abort_error)
                elif xfer._cancel_requested:
                    xfer._finish(TransferAbortedError(f"{what} was cancelled" + (" after it started" if partial else ""), partial=partial))
                else:
                    xfer._finish(TransferTimeoutError(f"{what} did not complete within {timeout:g}s (via {xfer.backend})"))
        finally:
            if not xfer.done():
                xfer._finish(ClosedError(f"transport {self.name!r} closed while {xfer!r} was running"))
            self._inflight.get(xfer.peer, set()).discard(xfer)
            self._record_end(xfer)

    def _record_end(self: Transport, xfer: Transfer) -> None:
        err = xfer.exception()
        if err is None:
            state = OpState.DONE
        elif isinstance(err, (TransferAbortedError, TransferTimeoutError, ClosedError)):
            state = OpState.ABORTED
        else:
            state = OpState.FAILED
        self._flight.transition(xfer._rec, state, backend=xfer.backend, error=err)
        if isinstance(err, PeerLostError) and xfer._incarnation is not None:
            # A backend saw the peer die (e.g. ESRCH, connection reset): act on it for everyone.
            self._declare_lost(xfer.peer, xfer._incarnation, err)
        elif isinstance(err, TransferTimeoutError):
            self._flight.dump(f"timeout: {err}", force=False)
