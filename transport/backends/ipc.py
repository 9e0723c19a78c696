"""``ipc``: same-host, one-sided copies into a peer's registered host memory.

Two paths, both run on the native copy engine's threads (never on the event loop):

* the region lives in a library-allocated shareable buffer (``Transport.empty``): this process
  maps the owner's memfd through ``/proc/<pid>/fd/<n>`` once and copies with ``memcpy``;
* any other registered tensor: Linux cross-memory attach (``process_vm_writev/readv``) straight
  into the owner's address range.

Device memory (CUDA tensors, registered or local) goes through CUDA IPC handles and
``cuMemcpyAsync`` instead: see :mod:`transport.backends._cuda_ipc`.

None of these needs the target's Python to run: a target blocked in ``time.sleep`` still receives.
CMA needs ptrace permission (same user, and under Yama ``ptrace_scope=1`` the target must allow
it); when refused, the backend says so and the Transport falls back to the next backend.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
from typing import TypeVar

from .. import _native
from .._errors import PeerLostError, TransportInternalError
from .._host import process_alive
from .._native import CopyKind, CopyResult, CopyStatus, PeerMapping
from .._regions import Region
from .._staging import bounce
from .._tensors import MemoryKind
from .._wire import PeerRecord, RegionRecord, TransferOp
from ._base import Backend, BackendContext, LocalBuffer, RemoteTarget
from ._cuda_ipc import CudaIpc, is_device

# pid, address of a readable probe byte, memfd of the control page (-1: none)
_ENDPOINT = struct.Struct("<qQq")
_CTL_SEQ = 0  # byte offset in the control page of the published record's seq (a u64)
_REGION = struct.Struct("<QQqQ")  # address, nbytes, memfd number (-1: none), offset in the memfd

_Key = TypeVar("_Key", bound=tuple[str, ...])  # (peer, incarnation, ...)
_Value = TypeVar("_Value")


def _forget(cache: dict[_Key, _Value], peer: str) -> None:
    """Drops the entries of every incarnation of ``peer``."""
    for k in [k for k in cache if k[0] == peer]:
        del cache[k]


class IpcBackend(Backend):
    name = "ipc"
    one_sided = True
    memory_kinds = frozenset({MemoryKind.CPU, MemoryKind.CUDA})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not sys.platform.startswith("linux"):
            return "ipc needs Linux (process_vm_writev, memfd)"
        return _native.unavailable_reason()

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._cma: dict[tuple[str, str], str | None] = {}  # (peer, incarnation) -> refusal
        self._maps: dict[tuple[str, str, str], PeerMapping] = {}  # (peer, incarnation, key) -> mapping
        self._map_errors: dict[tuple[str, str, str], str] = {}
        # A page peers map read-only: it holds the seq of our latest published record, so an
        # initiator notices a (un)registration with one memory load before it writes.
        self._ctl = _native.shared_buffer(4096, f"transport:{ctx.name}:ctl")
        self._peer_ctl: dict[tuple[str, str], PeerMapping | None] = {}
        if ctx.cuda is None:
            raise TransportInternalError("the ipc backend needs the Transport's CUDA copier (BackendContext.cuda)")
        self._cuda = CudaIpc(ctx.pid, ctx.cuda)

    def endpoint_descriptor(self) -> bytes:
        return _ENDPOINT.pack(self.ctx.pid, _native.probe_address(), self._ctl.fd)

    def published(self, seq: int) -> None:
        self._ctl.write_u64(_CTL_SEQ, seq)

    def live_seq(self, peer: PeerRecord) -> int | None:
        if peer.host != self.ctx.host or "ipc" not in peer.backends:
            return None
        cache_key = (peer.name, peer.incarnation)
        if cache_key not in self._peer_ctl:
            _pid, _probe, ctl_fd = _ENDPOINT.unpack(peer.backends["ipc"])
            try:
                self._peer_ctl[cache_key] = PeerMapping(peer.pid, ctl_fd, 4096, False)
            except RuntimeError:
                self._peer_ctl[cache_key] = None
        m = self._peer_ctl[cache_key]
        if m is None:
            return None
        return m.read_u64(_CTL_SEQ)

    def region_descriptor(self, region: Region) -> bytes | None:
        if region.device != "cpu":
            return self._cuda.region_descriptor(region)
        fd, fd_offset = -1, 0
        if region.shared is not None:
            fd, fd_offset = region.shared.fd, region.address - region.shared.address
        return _REGION.pack(region.address, region.nbytes, fd, fd_offset)

    # -- reachability -------------------------------------------------------------------------

    def cma_refusal(self, peer: PeerRecord) -> str | None:
        """None when CMA into ``peer`` is permitted, else the reason (cached per incarnation)."""
        cache_key = (peer.name, peer.incarnation)
        if cache_key not in self._cma:
            pid, probe, _ctl = _ENDPOINT.unpack(peer.backends["ipc"])
            err = _native.cma_probe(pid, probe)
            if err == 0:
                self._cma[cache_key] = None
            elif err == errno.EPERM:
                self._cma[cache_key] = (
                    f"cross-memory attach into {peer.name} (pid {pid}) is not permitted (EPERM): "
                    "it runs as another user, or Yama ptrace_scope>=1 forbids it; allocate the "
                    "region with Transport.empty() (shared mapping) or let the target call "
                    "prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)"
                )
            else:
                self._cma[cache_key] = f"cross-memory attach probe of {peer.name} failed: {os.strerror(err)}"
        return self._cma[cache_key]

    def _mapping(self, peer: PeerRecord, region: RegionRecord) -> PeerMapping | None:
        _addr, nbytes, fd, fd_offset = _REGION.unpack(region.descriptors["ipc"])
        if fd < 0:
            return None
        cache_key = (peer.name, peer.incarnation, region.key)
        m = self._maps.get(cache_key)
        if m is not None and m.nbytes >= fd_offset + nbytes:
            return m
        if m is not None:  # too small for this region: replaced below, so no longer pinned
            self._cuda.unpin(m.address, m.nbytes)
        if cache_key in self._map_errors:
            return None
        try:
            m = PeerMapping(peer.pid, fd, fd_offset + nbytes, region.writable)
        except RuntimeError as exc:
            self._map_errors[cache_key] = str(exc)
            return None
        self._maps[cache_key] = m
        return m

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        if peer.host != self.ctx.host:
            return f"{peer.name} is on another host or PID namespace"
        if "ipc" not in region.descriptors or "ipc" not in peer.backends:
            return f"{peer.name} published no ipc descriptor for {region.key!r}"
        if is_device(region) or local == MemoryKind.CUDA:
            has_mapping = not is_device(region) and self._mapping(peer, region) is not None
            return self._cuda.unreachable_reason(peer, region, local, has_mapping, lambda: self.cma_refusal(peer))
        if self._mapping(peer, region) is not None:
            return None
        refusal = self.cma_refusal(peer)
        if refusal is None:
            return None
        mapping_error = self._map_errors.get((peer.name, peer.incarnation, region.key))
        return refusal + (f"; shared mapping failed too: {mapping_error}" if mapping_error else "")

    # -- data path ----------------------------------------------------------------------------

    async def move(self, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        write = op == TransferOp.PUT
        peer, region = remote.peer, remote.region
        if is_device(region) or local.kind == MemoryKind.CUDA:
            await self._copy_cuda(local, remote, op)
            return
        addr, _nbytes, _fd, fd_offset = _REGION.unpack(region.descriptors["ipc"])
        mapping = self._mapping(peer, region)
        if mapping is not None:
            there = mapping.address + fd_offset + remote.offset
            kind, pid = CopyKind.LOCAL, 0
        else:
            there = addr + remote.offset
            kind, pid = (CopyKind.CMA_WRITE if write else CopyKind.CMA_READ), peer.pid
        seg = (there, local.address, remote.nbytes) if write else (local.address, there, remote.nbytes)
        # `mapping` stays referenced until the copy finished: it cannot be unmapped under it.
        result = await self.ctx.copier.copy(kind, pid, [seg])
        self._raise_for(result, peer, region, remote)

    async def _copy_cuda(self, local: LocalBuffer, remote: RemoteTarget, op: TransferOp) -> None:
        peer, region = remote.peer, remote.region
        if is_device(region):
            await self._cuda.copy_device(peer, local, remote, op)
            return
        addr, _nbytes, _fd, fd_offset = _REGION.unpack(region.descriptors["ipc"])
        mapping = self._mapping(peer, region)
        if mapping is not None:
            there = mapping.address + fd_offset + remote.offset
            await self._cuda.copy_mapped(local, there, (mapping.address, mapping.nbytes, not region.writable),
                                         remote.nbytes, op)
            return
        # Reachable by cross-memory attach only: through pinned staging, piece by piece.
        there, kind = addr + remote.offset, (CopyKind.CMA_WRITE if op == TransferOp.PUT else CopyKind.CMA_READ)
        async with bounce(local, remote.nbytes, self._cuda.copier_factory) as b:
            for pos, size in b.pieces:
                staging = b.buffer(size).address
                if op == TransferOp.PUT:
                    await b.load(pos, size)
                    seg = (there + pos, staging, size)
                else:
                    seg = (staging, there + pos, size)
                self._raise_for(await self.ctx.copier.copy(kind, peer.pid, [seg]), peer, region, remote)
                if op == TransferOp.GET:
                    await b.store(pos, size)

    def _raise_for(self, result: CopyResult, peer: PeerRecord, region: RegionRecord, remote: RemoteTarget) -> None:
        if result.status == CopyStatus.OK:
            return
        what = f"ipc transfer of {remote.nbytes} bytes at offset {remote.offset} of {peer.name}:{region.key!r}"
        if result.status == CopyStatus.ABORTED:
            raise PeerLostError(f"{what} was aborted by shutdown after {result.nbytes} bytes")
        if result.err == errno.ESRCH or not process_alive(peer.pid, peer.pid_start):
            raise PeerLostError(f"{what} failed: {peer.name} (pid {peer.pid}) has exited")
        if result.err == errno.EFAULT:
            raise PeerLostError(
                f"{what} failed: the range is no longer mapped in {peer.name} "
                "(was the tensor freed while registered?)"
            )
        raise TransportInternalError(f"{what} failed: {result.describe_errno()}")

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        await self.move(TransferOp.PUT, local, remote)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        await self.move(TransferOp.GET, local, remote)

    def forget_peer(self, peer: str) -> None:
        self._cuda.forget_peer(peer)
        for k, m in self._maps.items():
            if k[0] == peer:
                self._cuda.unpin(m.address, m.nbytes)
        _forget(self._cma, peer)
        _forget(self._maps, peer)
        _forget(self._map_errors, peer)
        _forget(self._peer_ctl, peer)

    def close(self) -> None:
        for m in self._maps.values():  # page-locked mappings are unpinned before they are unmapped
            self._cuda.unpin(m.address, m.nbytes)
        self._maps.clear()
        self._peer_ctl.clear()
