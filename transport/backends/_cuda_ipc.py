"""The CUDA half of the ``ipc`` backend: same-host copies that touch device memory.

* A registered CUDA tensor is published as its allocation's legacy CUDA IPC handle plus the
  tensor's offset in that allocation (found with ``cuMemGetAddressRange``, as PyTorch's own
  storage sharing does, so tensors carved out of the caching allocator's blocks work). A peer
  opens the handle once (cached per peer incarnation, closed when the peer goes away) and
  copies with ``cuMemcpyAsync`` on a transport-owned stream.
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import _cuda
from .._errors import BackendUnavailableError, TransportInternalError
from .._regions import Region
from .._tensors import MemoryKind, Runs
from .._wire import PeerRecord, RegionRecord, TransferOp
from ._base import LocalBuffer, RemoteTarget

_DEVICE_REGION = struct.Struct("<64sQQQ")  # IPC handle, allocation base, offset in it, nbytes
_REFUSED = b"!"  # a descriptor that carries why the region cannot be exported instead


def is_device(region: RegionRecord) -> bool:
    return region.device != "cpu"


class CudaIpc:
    """CUDA IPC for one :class:`IpcBackend` (created on the first device-memory use)."""

    def __init__(self, pid: int, copier: Callable[[], _cuda.CudaCopier]) -> None:
        self._pid = pid  # a region of this very process (another Transport in it, or ourselves)
        # is used at its own address: CUDA IPC cannot open a handle in the process that made it
        self._copier_of = copier  # the Transport's CUDA copier (it closes it, after this backend)
        self._used = False

    @property
    def copier(self) -> _cuda.CudaCopier:
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
    ) -> tuple[int, int, _cuda.IpcImportKey | None]:
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

    def copier_factory(self) -> _cuda.CudaCopier:
        """The CUDA copier, for a bounce buffer (``transport._staging.bounce``)."""
        return self.copier

    async def copy_device(self, peer: PeerRecord, local: LocalBuffer, remote: RemoteTarget, op: TransferOp) -> None:
        """Moves ``remote.nbytes`` between ``local`` (host or device) and the peer's device region."""
        eng = self.copier
        there, device, held = self._device_copy_target(peer, remote, local)
        dst, src = (there, local.address) if op == TransferOp.PUT else (local.address, there)
        try:
            await eng.copy(dst, src, remote.nbytes, device, local.ready)
        finally:
            if held is not None:
                eng.release_ipc(held)

    async def copy_device_many(self, peer: PeerRecord, lists: Sequence[tuple[Runs, RegionRecord]], op: TransferOp,
                               ready: Mapping[int, Any] | None) -> None:
        """Moves every run, each between a local CUDA tensor and a device region of ``peer`` (a
        prepared transfer's device runs): per copying device, after ``ready`` (the events
        recorded at start() on the local tensors' devices, by index; recorded now where absent),
        all runs are enqueued on the copier's stream and waited for once; many runs whose both
        sides are that device's memory go by one batched-copy kernel launch
        (:meth:`_cuda.CudaCopier.copy_many`). The peer's IPC imports are held until then."""
        eng = self.copier
        held: list[_cuda.IpcImportKey] = []
        groups: dict[int, tuple[list[tuple[int, int, int]], list[bool]]] = {}  # device -> (copies, on it)
        anchors = {r.local.tensor.device.index: r.local.tensor for r, _ in lists}
        events = [(ready or {}).get(d) or _cuda.ready_event(t) for d, t in anchors.items()]
        try:
            for runs, region in lists:
                local = runs.local
                there, device, key = self._device_copy_target(peer, RemoteTarget(peer, region, 0, region.nbytes),
                                                              local)
                if key is not None:
                    held.append(key)
                copies, on_device = groups.setdefault(device, ([], []))
                copies.extend(map(tuple, runs.copies(op == TransferOp.PUT, there).tolist()))
                on_device.append(local.tensor.device.index == device and _cuda.local_index(region.device) == device)
            for device, (copies, on_device) in groups.items():
                await eng.copy_many(copies, device, kernel=all(on_device), ready=events)
        finally:
            for key in held:
                eng.release_ipc(key)

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
            await eng.copy(dst, src, nbytes, device, local.ready)
        finally:  # an unpin asked for meanwhile happens now, not under the DMA
            eng.release_pin(pinned)

    def forget_peer(self, peer: str) -> None:
        if self._used:
            self.copier.forget_peer(peer)

    def unpin(self, address: int, nbytes: int) -> None:
        """Call before a host mapping this backend may have page-locked is unmapped."""
        if self._used:
            self.copier.unpin(address, nbytes)
