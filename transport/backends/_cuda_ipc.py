"""The CUDA half of the ``ipc`` backend: same-host copies that touch device memory.

* A registered CUDA tensor is published as its allocation's legacy CUDA IPC handle plus the
  tensor's offset in that allocation (found with ``cuMemGetAddressRange``, as PyTorch's own
  storage sharing does, so tensors carved out of the caching allocator's blocks work). A peer
  opens the handle once (cached per peer incarnation, closed when the peer goes away) and
  copies with ``cuMemcpyAsync`` on a transport-owned stream.
* Copies are enqueued on the calling thread (the event loop's) and their ends learnt from the
  CUDA copier's engine: a put or get whose route is known is enqueued inside ``put()`` itself
  (:meth:`CudaIpc.mover`) and, when short, completed there too; a prepared transfer's device runs
  are laid out once per peer record (:meth:`CudaIpc.prepare_runs`) and cost one enqueue (one
  kernel launch, or one ``cuMemcpyAsync`` per run) per start.
* Device <-> a peer's host region: into its shared mapping (``Transport.empty``), page-locked
  once with ``cuMemHostRegister``; or, for other host regions, through a pinned staging buffer
  and cross-memory attach.

See :mod:`transport._cuda` for the stream semantics.

``writable=False`` is not enforced for device regions against a peer that ignores it: a legacy
CUDA IPC handle always opens read-write. A peer's read-only *host* region reached through its
shared mapping is mapped ``PROT_READ`` and page-locked read-only (see the ``ipc`` module).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import torch

from .. import _cuda, _pieces
from .._cuda_copier import CudaCopier, DeviceBatch, DeviceCopy, IpcImportKey
from .._errors import BackendUnavailableError, TransportInternalError
from .._native import PeerMapping, pack_segments
from .._pieces import Ready, ready_of, ready_on
from .._regions import Region
from .._tensors import MemoryKind, Runs
from .._wire import PeerRecord, RegionRecord, TransferOp
from ._base import DeviceMover, LocalBuffer, Pending, RemoteTarget, Runner

_DEVICE_REGION = struct.Struct("<64sQQQ")  # IPC handle, allocation base, offset in it, nbytes
_REFUSED = b"!"  # a descriptor that carries why the region cannot be exported instead


def is_device(region: RegionRecord) -> bool:
    return region.device != "cpu"


class CudaIpc:
    """CUDA IPC for one :class:`IpcBackend` (created on the first device-memory use)."""

    def __init__(self, pid: int, copier: Callable[[], CudaCopier]) -> None:
        self._pid = pid  # a region of this very process (another Transport in it, or ourselves)
        # is used at its own address: CUDA IPC cannot open a handle in the process that made it
        self._copier_of = copier  # the Transport's CUDA copier (it closes it, after this backend)
        self._used = False

    @property
    def copier(self) -> CudaCopier:
        self._used = True
        return self._copier_of()

    def region_descriptor(self, region: Region) -> bytes:
        desc = region.backend_state.get("ipc")  # exported once per registration
        if desc is None and region.nbytes == 0:  # nothing to export (its data_ptr may be 0)
            desc = region.backend_state["ipc"] = _DEVICE_REGION.pack(b"\0" * 64, 0, 0, 0)
        if desc is None:
            try:
                alloc = _cuda.allocation(region.address, region.tensor.device.index)
                handle = _cuda.ipc_export(alloc)
                desc = _DEVICE_REGION.pack(handle, alloc.base, region.address - alloc.base, region.nbytes)
            except (BackendUnavailableError, TransportInternalError) as exc:
                desc = _REFUSED + str(exc).encode()
            region.backend_state["ipc"] = desc
        return desc

    def unreachable_reason(
        self,
        peer: PeerRecord,
        region: RegionRecord,
        local: MemoryKind,
        has_mapping: bool,
        cma_refusal: Callable[[], str | None],
    ) -> str | None:
        reason = _cuda.unavailable_reason()
        if reason is not None:
            return reason
        if is_device(region):
            if region.nbytes == 0:
                return None
            desc = region.descriptors["ipc"]
            if desc.startswith(_REFUSED):
                return f"{peer.name} cannot export {region.key!r}: {desc[1:].decode(errors='replace')}"
            if peer.pid != self._pid and local != MemoryKind.CUDA and _cuda.local_index(region.device) is None:
                return f"{peer.name}'s GPU {region.device.removeprefix('cuda:')} is not visible to this process"
            return None
        # Device memory here, host memory there: its shared mapping, or CMA through staging.
        return None if has_mapping else cma_refusal()

    def _open_device(self, region: RegionRecord, local: LocalBuffer | None) -> int | None:
        """The device to open a peer's allocation on: the same GPU if this process sees it,
        else the local tensor's (peer access is enabled lazily)."""
        index = _cuda.local_index(region.device)
        if index is None and local is not None and local.kind == MemoryKind.CUDA:
            index = local.tensor.device.index
        return index

    def _device_copy_target(
        self, peer: PeerRecord, remote: RemoteTarget, local: LocalBuffer
    ) -> tuple[int, int, IpcImportKey | None]:
        """(address of the remote range in this process, device to copy on, the IPC import held
        for the copy or None); release the import with ``copier.release_ipc``."""
        handle, base, offset, _nbytes = _DEVICE_REGION.unpack(remote.region.descriptors["ipc"])
        device = self._open_device(remote.region, local)
        if device is None:
            raise BackendUnavailableError(f"{peer.name}'s GPU {remote.region.device} is not visible here")
        if peer.pid == self._pid:  # a region of this process: its own address
            return base + offset + remote.offset, device, None
        try:
            held = self.copier.acquire_ipc(peer.name, peer.incarnation, handle, device)
        except TransportInternalError as exc:
            if _cuda.local_index(remote.region.device) is not None:
                raise
            raise BackendUnavailableError(
                f"{peer.name}'s GPU {remote.region.device.removeprefix('cuda:')} is not visible to this process "
                f"and its CUDA IPC handle does not open on device {device} ({exc}): give both processes a view of "
                "both GPUs (CUDA_VISIBLE_DEVICES), or use nccl"
            ) from exc
        return held[1] + offset + remote.offset, device, held[0]

    def copier_factory(self) -> CudaCopier:
        """The CUDA copier, for a bounce buffer (``transport._staging.bounce``)."""
        return self.copier

    async def copy_device(self, peer: PeerRecord, local: LocalBuffer, remote: RemoteTarget, op: TransferOp) -> None:
        """Moves ``remote.nbytes`` between ``local`` (host or device) and the peer's device region."""
        eng = self.copier
        there, device, held = self._device_copy_target(peer, remote, local)
        dst, src = (there, local.address) if op == TransferOp.PUT else (local.address, there)
        host = local.kind == MemoryKind.CPU
        try:
            await eng.copy(dst, src, remote.nbytes, device, ready_of(local), host=host,
                           pageable=host and not local.tensor.is_pinned())
        finally:
            if held is not None:
                eng.release_ipc(held)

    def mover(self, op: TransferOp, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> DeviceMover | None:
        """The synchronous path of a transfer between ``local`` memory here and ``peer``'s
        device region (see ``Backend.device_mover``): the copy is enqueued inside ``put()``
        and completed there when it ends within its short poll. Local host memory that is not
        page-locked is declined (its copy would block the event loop: it takes the worker
        thread of the asynchronous path)."""
        if region.nbytes == 0:
            return None
        handle, base, offset, _nbytes = _DEVICE_REGION.unpack(region.descriptors["ipc"])
        visible = _cuda.local_index(region.device)
        own = peer.pid == self._pid
        put = op == TransferOp.PUT
        eng = self.copier

        def move(tensor: torch.Tensor, at: int, nbytes: int) -> bool | Pending:
            here = tensor.data_ptr()
            cuda_here = tensor.is_cuda
            if not cuda_here and not tensor.is_pinned():
                return False
            device = visible if visible is not None else tensor.device.index
            held: IpcImportKey | None = None
            if own:
                there = base + offset + at
            else:
                try:
                    held, ptr = eng.acquire_ipc(peer.name, peer.incarnation, handle, device)
                except TransportInternalError:
                    return False  # the checked path reports it precisely
                there = ptr + offset + at
            after = ((tensor.device.index, _cuda.current_stream(tensor.device.index)),) if cuda_here else ()
            packed = pack_segments([(there, here, nbytes) if put else (here, there, nbytes)])
            return _started(lambda: eng.start(device, packed, nbytes=nbytes, host=not cuda_here, after=after),
                            lambda: eng.release_ipc(held) if held is not None else None)

        return move

    def mapped_mover(self, op: TransferOp, mapping: PeerMapping, at: int) -> DeviceMover:
        """The synchronous path of a transfer between a CUDA tensor here and a peer's host
        region mapped here (its bytes at ``mapping.address + at``): once the mapping is
        page-locked (the first, asynchronous transfer does that), the copy is enqueued and
        completed as :meth:`mover`'s."""
        eng = self.copier
        key = (mapping.address, mapping.nbytes)
        put = op == TransferOp.PUT
        start = mapping.address + at

        def move(tensor: torch.Tensor, offset: int, nbytes: int, _held: PeerMapping = mapping) -> bool | Pending:
            # `_held` keeps the mapping referenced (mapped) while this callable lives.
            if not tensor.is_cuda or not eng.pinned(*key):
                return False
            eng.hold_pin(key)
            device, there, here = tensor.device.index, start + offset, tensor.data_ptr()
            packed = pack_segments([(there, here, nbytes) if put else (here, there, nbytes)])
            after = ((device, _cuda.current_stream(device)),)
            return _started(lambda: eng.start(device, packed, nbytes=nbytes, host=True, after=after),
                            lambda: eng.release_pin(key))

        return move

    def prepare_runs(self, op: TransferOp, peer: PeerRecord, lists: Sequence[tuple[Runs, RegionRecord]]) -> Runner:
        """A reusable runner of a prepared transfer's device runs (each between a local CUDA
        tensor and a device region of ``peer``). Per copying device, the runs become one
        :class:`transport._cuda_copier.DeviceBatch` (a batched-copy kernel launch when there are many and both
        sides are that device's memory, else one ``cuMemcpyAsync`` each), laid out at the first
        start and kept while the peer's imports stay where they were. Each start enqueues every
        device's batch at once (``transport._pieces.run``, a piece per device), each after
        ``ready`` (the events recorded at start() on the local tensors' devices, by index: every
        one of them must be there), and waits for all; each device holds the peer's IPC imports
        it copies through until its batch has ended."""
        put = op == TransferOp.PUT
        own = peer.pid == self._pid  # a region of this process: used at its own address
        groups: dict[int, list[tuple[Runs, RegionRecord, bytes, int, int]]] = {}
        for runs, region in lists:
            handle, base, offset, _nbytes = _DEVICE_REGION.unpack(region.descriptors["ipc"])
            device = self._open_device(region, runs.local)
            if device is None:
                raise BackendUnavailableError(f"{peer.name}'s GPU {region.device} is not visible here")
            groups.setdefault(device, []).append((runs, region, handle, base, offset))
        anchors = sorted({r.local.tensor.get_device() for r, _ in lists})  # the local tensors' devices
        laid_out: dict[int, tuple[tuple[int, ...], DeviceBatch]] = {}  # device -> (bases, batch)

        def batch_for(device: int, bases: tuple[int, ...]) -> DeviceBatch:
            cached = laid_out.get(device)
            if cached is not None and cached[0] == bases:
                return cached[1]
            entries = groups[device]
            copies = [tuple(row) for (runs, *_), there in zip(entries, bases, strict=True)
                      for row in runs.copies(put, there).tolist()]
            kernel = all(runs.local.tensor.device.index == device and _cuda.local_index(region.device) == device
                         for runs, region, *_ in entries)
            batch = self.copier.batch(copies, device, kernel=kernel)
            laid_out[device] = (bases, batch)
            return batch

        async def run(ready: Ready) -> None:
            eng = self.copier
            events = [ready_on(ready, d) for d in anchors]

            async def copy(device: int) -> None:
                held: list[IpcImportKey] = []
                try:
                    bases = []
                    for _runs, _region, handle, base, offset in groups[device]:
                        if own:
                            bases.append(base + offset)
                            continue
                        key, ptr = eng.acquire_ipc(peer.name, peer.incarnation, handle, device)
                        held.append(key)
                        bases.append(ptr + offset)
                    # `batch` stays referenced until its job has ended (a kernel reads its table meanwhile).
                    batch = batch_for(device, tuple(bases))
                    await eng.start_batch(batch, ready=events).wait()  # cancelled: returns once they ended
                finally:
                    for key in held:
                        eng.release_ipc(key)

            await _pieces.run(list(groups), copy, None)

        return run

    async def copy_mapped(self, local: LocalBuffer, there: int, mapping: tuple[int, int, bool], nbytes: int,
                          op: TransferOp) -> None:
        """Moves ``nbytes`` between the CUDA tensor ``local`` and a peer's host region mapped here
        at ``there``; ``mapping`` = (address, nbytes, read_only) of the whole mapping, which is
        page-locked once so the copy is DMA."""
        eng = self.copier
        device = local.tensor.device.index
        pinned = await eng.pin(*mapping, device)
        try:
            dst, src = (there, local.address) if op == TransferOp.PUT else (local.address, there)
            await eng.copy(dst, src, nbytes, device, ready_of(local), pageable=not eng.pinned(*pinned))
        finally:  # an unpin asked for meanwhile happens now, not under the DMA
            eng.release_pin(pinned)

    def forget_peer(self, peer: str) -> None:
        if self._used:
            self.copier.forget_peer(peer)

    def unpin(self, mapping: PeerMapping) -> None:
        """Call when this backend lets go of a host mapping it may have page-locked: it is
        unlocked in the background, and stays mapped until then."""
        if self._used:
            self.copier.unpin(mapping.address, mapping.nbytes, hold=mapping)


def _started(start: Callable[[], DeviceCopy], release: Callable[[], None]) -> bool | Pending:
    """What a synchronous mover returns for a copy ``start`` enqueues: True when it ended within
    its poll, False when it failed (nothing enqueued, or it ended failed: the checked path
    moves it again and reports the error precisely), else a Pending that waits for it. ``release``
    lets go of what the copy holds, once it ended."""
    try:
        job = start()
    except TransportInternalError:
        release()
        return False
    if job.done():
        release()
        try:
            job.check()
        except TransportInternalError:
            return False
        return True

    async def pending() -> bool:
        try:
            await job.wait()  # cancellation: returns (re-raising) once the copy ended
        except TransportInternalError:
            return False
        finally:
            release()
        return True

    return pending
