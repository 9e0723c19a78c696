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

Read-only regions (``writable=False``), enforced by the kernel where it can be:

* a read-only region that spans a whole library buffer (``Transport.empty(..., writable=False)``)
  seals that buffer's memfd before it is published (``F_SEAL_FUTURE_WRITE``): the owner keeps
  writing through its own mapping, but no other process can map it writable or ``write(2)`` it
  any more, root included. A writable region over a sealed buffer (registered on purpose over
  its memory) is published without its memfd: peers write it by CMA only, or through another
  backend where CMA is not permitted;
* the address published for CMA into a read-only region of a library buffer is a second,
  ``PROT_READ`` mapping of it: ``process_vm_writev`` there fails with ``EFAULT``;
* what the kernel cannot enforce: a read-only view inside a buffer that is also writable (its
  memfd stays unsealed), read-only regions in ordinary memory, and any process allowed to
  ``ptrace`` the owner (it can write anywhere in it, e.g. at the addresses in
  ``/proc/<pid>/maps``). Device memory: CUDA IPC handles always open read-write.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.to_thread
import numpy as np

from .. import _native
from .._errors import PeerLostError, ReadOnlyRegionError, TransportInternalError
from .._host import process_alive
from .._native import CopyKind, CopyResult, CopyStatus, PeerMapping, SharedBuffer, copy_now
from .._pieces import Ready
from .._regions import Region
from .._staging import bounce
from .._tensors import MemoryKind, Runs
from .._wire import PeerRecord, RegionRecord, TransferOp
from ._base import Backend, BackendContext, DeviceMover, LocalBuffer, RemoteTarget, Runner
from ._control import SEQ_OFFSET, WITHDRAWN_SEQ, PeerControlPages, control_page
from ._cuda_ipc import CudaIpc, is_device

# pid, address of a readable probe byte, memfd of the control page (-1: none)
_ENDPOINT = struct.Struct("<qQq")
# A synchronous cross-memory-attach copy (one thread in the kernel, ~6 GB/s) up to this size;
# larger ones go to the copy threads. Mapped memfds are copied synchronously up to the
# Transport's limit (transfers.SYNC_MAX_BYTES).
_SYNC_CMA_MAX_BYTES = 1 << 20


def _endpoint(peer: PeerRecord) -> tuple[int, int, int] | None:
    """The peer's (pid, probe address, control page memfd number), or None when it published no
    ipc endpoint or one of another size (another version, or hostile): never unpacked blindly."""
    data = peer.backends.get("ipc")
    if data is None or len(data) != _ENDPOINT.size:
        return None
    pid, probe, ctl_fd = _ENDPOINT.unpack(data)
    return pid, probe, ctl_fd


def _malformed(peer: PeerRecord) -> str:
    n = len(peer.backends.get("ipc", b""))
    return f"{peer.name}'s ipc endpoint descriptor has {n} bytes, not {_ENDPOINT.size}: another version of transport?"
# A host region: address, nbytes, memfd number (-1: none), offset in the memfd, the memfd's inode
# (which tells it from a later memfd under the same number: mappings are cached by it).
_REGION = struct.Struct("<QQqQQ")

_NO_FD = -1

log = logging.getLogger(__name__)

_Key = TypeVar("_Key", bound=tuple[str, ...])  # (peer, incarnation, ...)
_Value = TypeVar("_Value")


def _forget(cache: dict[_Key, _Value], peer: str) -> None:
    """Drops the entries of every incarnation of ``peer``."""
    for k in [k for k in cache if k[0] == peer]:
        del cache[k]


@dataclass(frozen=True)
class _HostCopy:
    """One host range as the copy engine takes it (see ``IpcBackend._host_copy``)."""

    kind: CopyKind
    pid: int
    segment: tuple[int, int, int]  # (dst, src, nbytes)
    there: int  # the peer-side address (in our mapping, or in its process)
    mapping: PeerMapping | None  # referenced until the copy finished


class IpcBackend(Backend):
    name = "ipc"
    one_sided = True
    same_host = True
    memory_kinds = frozenset({MemoryKind.CPU, MemoryKind.CUDA})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not sys.platform.startswith("linux"):
            return "ipc needs Linux (process_vm_writev, memfd)"
        return _native.unavailable_reason()

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._cma: dict[tuple[str, str], str | None] = {}  # (peer, incarnation) -> refusal
        # (peer, incarnation, key) -> ((memfd number, inode, writable), mapping): a region
        # re-registered in another buffer, or with the other writability, is mapped anew.
        self._maps: dict[tuple[str, str, str], tuple[tuple[int, int, bool], PeerMapping]] = {}
        self._map_errors: dict[tuple[str, str, str], tuple[tuple[int, int, bool], str]] = {}
        self._ctl = control_page(ctx.name, "ctl")  # our latest record's seq, for peers (see _control)
        self._peer_ctl = PeerControlPages(ctx.name, self._ctl_page_of)
        if ctx.cuda is None:
            raise TransportInternalError("the ipc backend needs the Transport's CUDA copier (BackendContext.cuda)")
        self._cuda = CudaIpc(ctx.pid, ctx.cuda)

    def endpoint_descriptor(self) -> bytes:
        return _ENDPOINT.pack(self.ctx.pid, _native.probe_address(), self._ctl.fd)

    def published(self, seq: int) -> None:
        self._ctl.write_u64(SEQ_OFFSET, seq)

    def withdrawn(self) -> None:
        self._ctl.write_u64(SEQ_OFFSET, WITHDRAWN_SEQ)

    def live_seq(self, peer: PeerRecord) -> int | None:
        return self._peer_ctl.read(peer)

    def _ctl_page_of(self, peer: PeerRecord) -> tuple[int, int] | None:
        endpoint = _endpoint(peer) if peer.host == self.ctx.host else None
        return (endpoint[2], 0) if endpoint is not None else None  # (no inode published)

    def region_descriptor(self, region: Region) -> bytes | None:
        if region.device != "cpu":
            return self._cuda.region_descriptor(region)
        shared: SharedBuffer | None = region.shared
        if shared is None:  # ordinary memory: CMA at its address
            return _REGION.pack(region.address, region.nbytes, _NO_FD, 0, 0)
        offset = region.address - shared.address
        if region.writable:
            # A sealed memfd can no longer be mapped writable: peers write this one by CMA only.
            if shared.sealed:
                return _REGION.pack(region.address, region.nbytes, _NO_FD, 0, 0)
            return _REGION.pack(region.address, region.nbytes, shared.fd, offset, shared.inode)
        return self._read_only_descriptor(region, shared, offset)

    def _read_only_descriptor(self, region: Region, shared: SharedBuffer, offset: int) -> bytes | None:
        """A read-only region in a library buffer: its memfd sealed when the region spans all
        of it, and for CMA the address of the buffer's read-only alias mapping."""
        cached = region.backend_state.get("ipc")  # decided once per registration
        if cached is not None:
            return cached
        fd = shared.fd
        if offset == 0 and region.nbytes >= shared.nbytes and not shared.sealed:
            try:
                shared.seal_writes()  # before the record that publishes it exists
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # Linux < 5.1: as for ordinary memory, not enforced
                    log.warning("transport %s: peers that ignore writable=False can write %r: %s",
                                self.ctx.name, region.key, exc)
                else:  # e.g. another process sealed the seals: do not hand out a writable memfd
                    log.warning("transport %s: %r is published without its memfd (peers reach it by "
                                "cross-memory attach only): %s", self.ctx.name, region.key, exc)
                    fd = _NO_FD
        try:
            address = shared.read_only_address + offset
        except RuntimeError as exc:
            log.warning("transport %s: %r is not published for ipc: %s", self.ctx.name, region.key, exc)
            return None  # not cached: a later publish tries again
        desc = region.backend_state["ipc"] = _REGION.pack(address, region.nbytes, fd, offset,
                                                          shared.inode if fd != _NO_FD else 0)
        return desc

    # -- reachability -------------------------------------------------------------------------

    def cma_refusal(self, peer: PeerRecord) -> str | None:
        """None when CMA into ``peer`` is permitted, else the reason (cached per incarnation)."""
        cache_key = (peer.name, peer.incarnation)
        if cache_key not in self._cma:
            endpoint = _endpoint(peer)
            if endpoint is None:
                self._cma[cache_key] = _malformed(peer)
                return self._cma[cache_key]
            pid, probe, _ctl = endpoint
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
        _addr, nbytes, fd, fd_offset, inode = _REGION.unpack(region.descriptors["ipc"])
        if fd < 0:
            return None
        cache_key, ident = (peer.name, peer.incarnation, region.key), (fd, inode, region.writable)
        cached = self._maps.get(cache_key)
        if cached is not None and cached[0] == ident and cached[1].nbytes >= fd_offset + nbytes:
            return cached[1]
        if cached is not None:  # another memfd, writability or size: replaced, so no longer pinned
            del self._maps[cache_key]
            self._cuda.unpin(cached[1])
        failed = self._map_errors.get(cache_key)
        if failed is not None and failed[0] == ident:
            return None
        try:
            m = PeerMapping(peer.pid, fd, fd_offset + nbytes, region.writable, inode)
        except RuntimeError as exc:
            self._map_errors[cache_key] = (ident, str(exc))
            return None
        self._map_errors.pop(cache_key, None)
        self._maps[cache_key] = (ident, m)
        return m

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        if peer.host != self.ctx.host:
            return f"{peer.name} is on another host or PID namespace"
        if "ipc" not in region.descriptors or "ipc" not in peer.backends:
            return f"{peer.name} published no ipc descriptor for {region.key!r}"
        if _endpoint(peer) is None:
            return _malformed(peer)
        if not is_device(region) and len(region.descriptors["ipc"]) != _REGION.size:
            return (f"{peer.name}'s ipc descriptor for {region.key!r} has {len(region.descriptors['ipc'])} bytes, "
                    f"not {_REGION.size}: another version of transport?")
        if is_device(region) or local == MemoryKind.CUDA:
            has_mapping = not is_device(region) and self._mapping(peer, region) is not None
            return self._cuda.unreachable_reason(peer, region, local, has_mapping, lambda: self.cma_refusal(peer))
        if self._mapping(peer, region) is not None:
            return None
        refusal = self.cma_refusal(peer)
        if refusal is None:
            return None
        failed = self._map_errors.get((peer.name, peer.incarnation, region.key))
        return refusal + (f"; shared mapping failed too: {failed[1]}" if failed else "")

    # -- data path ----------------------------------------------------------------------------

    def _host_path(self, op: TransferOp, peer: PeerRecord,
                   region: RegionRecord) -> tuple[CopyKind, int, int, PeerMapping | None]:
        """How host bytes reach a host region: (copy kind, pid, the region's address, mapping).
        Through this process's mapping of the peer's memfd (memcpy), else cross-memory attach
        at the peer's address."""
        addr, _nbytes, _fd, fd_offset, _inode = _REGION.unpack(region.descriptors["ipc"])
        mapping = self._mapping(peer, region)
        if mapping is not None:
            return CopyKind.LOCAL, 0, mapping.address + fd_offset, mapping
        return (CopyKind.CMA_WRITE if op == TransferOp.PUT else CopyKind.CMA_READ), peer.pid, addr, None

    def _host_copy(self, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> _HostCopy | None:
        """How one host range is copied (None when either side is CUDA memory)."""
        if is_device(remote.region) or local.kind == MemoryKind.CUDA:
            return None
        kind, pid, base, mapping = self._host_path(op, remote.peer, remote.region)
        there = base + remote.offset
        seg = (there, local.address, remote.nbytes) if op == TransferOp.PUT else (local.address, there, remote.nbytes)
        return _HostCopy(kind, pid, seg, there, mapping)

    def mover(self, op: TransferOp, peer: PeerRecord, region: RegionRecord) -> Callable[[int, int, int], bool] | None:
        """A memcpy into this process's mapping of the peer's memfd, else one cross-memory
        attach call (up to ``_SYNC_CMA_MAX_BYTES``: a larger one runs faster on the copy
        threads), on the calling thread (the GIL released)."""
        if is_device(region) or self.unreachable_reason(peer, region, MemoryKind.CPU) is not None:
            return None
        kind, pid, base, mapping = self._host_path(op, peer, region)
        write = op == TransferOp.PUT
        limit = _SYNC_CMA_MAX_BYTES if kind != CopyKind.LOCAL else None

        def move(local: int, offset: int, nbytes: int, _held: PeerMapping | None = mapping) -> bool:
            # `_held` keeps the mapping referenced (mapped) while this callable lives.
            if limit is not None and nbytes > limit:
                return False
            there = base + offset
            err = copy_now(kind, pid, there, local, nbytes) if write else copy_now(kind, pid, local, there, nbytes)
            return err == 0

        return move

    def device_mover(self, op: TransferOp, peer: PeerRecord, region: RegionRecord,
                     local: MemoryKind) -> DeviceMover | None:
        """CUDA memory on either side: the copy enqueued on the calling thread (see
        :meth:`CudaIpc.mover`), into a peer's device region or, from a CUDA tensor, into its host
        region mapped here. A host region reached by cross-memory attach only goes through
        staging, on the asynchronous path."""
        if self.unreachable_reason(peer, region, local) is not None:
            return None
        if is_device(region):
            return self._cuda.mover(op, peer, region, local)
        mapping = self._mapping(peer, region) if local == MemoryKind.CUDA else None
        if mapping is None:
            return None
        _addr, _nbytes, _fd, fd_offset, _inode = _REGION.unpack(region.descriptors["ipc"])
        return self._cuda.mapped_mover(op, mapping, fd_offset)

    async def move(self, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        host = self._host_copy(op, local, remote)
        if host is None:
            await self._copy_cuda(local, remote, op)
            return
        # `host.mapping` stays referenced until the copy finished: it cannot be unmapped under it.
        result = await self.ctx.copier.copy(host.kind, host.pid, [host.segment])
        self._raise_for(result, remote.peer, remote.region, remote,
                        op == TransferOp.PUT and host.kind == CopyKind.CMA_WRITE, host.there)

    def prepare_runs(self, op: TransferOp, peer: PeerRecord, lists: Sequence[tuple[Runs, RegionRecord]]) -> Runner:
        """Host memory on both sides: the arrays become one native copy plan per copy kind
        (mapped memfd: memcpy; elsewhere: cross-memory attach, IOV_MAX runs per system call)
        as they are (the region's address added to one column, the tensor's to the other),
        cut into chunks and grouped into units of work once (``Copier.plan``); each run submits
        the plans by handle, split across the copy engine's threads. A failed
        job is retried run by run, which raises the precise error. Device-to-device runs (CUDA
        IPC) are laid out once and enqueued together on the CUDA copier's stream, then waited
        for once (:meth:`CudaIpc.prepare_runs`); other runs with CUDA memory go run by run."""
        jobs: dict[tuple[CopyKind, int], tuple[list[np.ndarray], list[tuple[Runs, RegionRecord]]]] = {}
        devices: list[tuple[Runs, RegionRecord]] = []
        slow: list[tuple[Runs, RegionRecord]] = []
        held: list[PeerMapping] = []
        for runs, region in lists:
            cuda_here = runs.local.kind == MemoryKind.CUDA
            if is_device(region) or cuda_here:
                (devices if is_device(region) and cuda_here else slow).append((runs, region))
                continue
            kind, pid, base, mapping = self._host_path(op, peer, region)
            if mapping is not None:
                held.append(mapping)
            arrays, members = jobs.setdefault((kind, pid), ([], []))
            arrays.append(runs.copies(op == TransferOp.PUT, base))
            members.append((runs, region))
        plans = [(self.ctx.copier.plan(kind, pid, np.concatenate(arrays).astype(np.uint64).tobytes()), members)
                 for (kind, pid), (arrays, members) in jobs.items()]
        one_by_one = Backend.prepare_runs(self, op, peer, slow) if slow else None
        device_runs = self._cuda.prepare_runs(op, peer, devices) if devices else None

        async def run(ready: Ready, _held: list[PeerMapping] = held) -> None:
            # `_held` keeps the mappings referenced (mapped) while this runner lives.
            for plan, members in plans:
                result = await self.ctx.copier.copy_plan(plan)
                if result.status != CopyStatus.OK:
                    await Backend.prepare_runs(self, op, peer, members)(ready)
            if device_runs is not None:
                await device_runs(ready)
            if one_by_one is not None:
                await one_by_one(ready)

        return run

    async def warm(self, op: TransferOp, peer: PeerRecord, lists: Sequence[tuple[Runs, RegionRecord]]) -> None:
        """Maps the peer's memfds the host runs go through and fills this process's page
        tables for the pages they touch (``MADV_POPULATE_WRITE`` for a put, ``_READ`` for a
        get), on a worker thread: a first copy through a fresh mapping otherwise takes a page
        fault per page, several times the copy itself (benchmarks/results/
        first-push-2026-12-03.md). Only those pages: populating a hole of the owner's memfd
        allocates it, as the copy would. Runs by cross-memory attach or with CUDA memory have
        nothing to ready."""
        put = op == TransferOp.PUT
        fills: dict[int, tuple[PeerMapping, list[np.ndarray]]] = {}
        for runs, region in lists:
            if is_device(region) or runs.local.kind == MemoryKind.CUDA:
                continue
            _kind, _pid, base, mapping = self._host_path(op, peer, region)
            if mapping is not None:
                fills.setdefault(id(mapping), (mapping, []))[1].append(runs.copies(put, base))
        for mapping, rows in fills.values():
            packed = np.concatenate(rows).astype(np.uint64).tobytes()
            err = await anyio.to_thread.run_sync(mapping.populate, packed, 0 if put else 1, put)
            if err:  # e.g. a kernel before 5.14: the first copy faults the pages in, as without this
                log.info("ipc: cannot fill the page tables for %s's memory ahead of a transfer: %s",
                         peer.name, os.strerror(err))

    async def _copy_cuda(self, local: LocalBuffer, remote: RemoteTarget, op: TransferOp) -> None:
        peer, region = remote.peer, remote.region
        if is_device(region):
            await self._cuda.copy_device(peer, local, remote, op)
            return
        addr, _nbytes, _fd, fd_offset, _inode = _REGION.unpack(region.descriptors["ipc"])
        mapping = self._mapping(peer, region)
        if mapping is not None:
            there = mapping.address + fd_offset + remote.offset
            await self._cuda.copy_mapped(local, there, (mapping.address, mapping.nbytes, not region.writable),
                                         remote.nbytes, op)
            return
        # Reachable by cross-memory attach only: through pinned staging, piece by piece.
        there, put = addr + remote.offset, op == TransferOp.PUT
        kind = CopyKind.CMA_WRITE if put else CopyKind.CMA_READ

        async def attach(staging: LocalBuffer, pos: int, size: int) -> None:
            seg = (there + pos, staging.address, size) if put else (staging.address, there + pos, size)
            result = await self.ctx.copier.copy(kind, peer.pid, [seg])
            self._raise_for(result, peer, region, remote, put, there + pos)

        async with bounce(local, remote.nbytes, self._cuda.copier_factory) as b:
            await b.each(op, attach)

    def _raise_for(self, result: CopyResult, peer: PeerRecord, region: RegionRecord, remote: RemoteTarget,
                   write: bool = False, there: int = 0) -> None:
        """Maps a failed copy to the error tree (``write``/``there``: a CMA write, and where)."""
        if result.status == CopyStatus.OK:
            return
        what = f"ipc transfer of {remote.nbytes} bytes at offset {remote.offset} of {peer.name}:{region.key!r}"
        if result.status == CopyStatus.ABORTED:
            raise PeerLostError(f"{what} was aborted by shutdown after {result.nbytes} bytes")
        if result.err == errno.ESRCH or not process_alive(peer.pid, peer.pid_start):
            raise PeerLostError(f"{what} failed: {peer.name} (pid {peer.pid}) has exited")
        if result.err == errno.EFAULT and write and _native.cma_probe(peer.pid, there + result.nbytes) == 0:
            # Where the write failed it is mapped and readable, yet not writable: a read-only region.
            raise ReadOnlyRegionError(f"{what} refused: {peer.name} maps {region.key!r} read-only")
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
        for k, (_ident, m) in self._maps.items():
            if k[0] == peer:
                self._cuda.unpin(m)
        _forget(self._cma, peer)
        _forget(self._maps, peer)
        _forget(self._map_errors, peer)
        self._peer_ctl.forget(peer)

    def close(self) -> None:
        for _ident, m in self._maps.values():  # page-locked mappings are unpinned before they are unmapped
            self._cuda.unpin(m)
        self._maps.clear()
        self._peer_ctl.clear()
